"""Server load from a Prometheus `/metrics` page: running and waiting requests, KV usage.

Each serving engine names the same three gauges differently; the list below maps
the names each one documents onto ours. A server that publishes none of them (or no
`/metrics` at all: mlx_lm.server) reports nothing, and the charts say so instead of
inventing numbers.

    running   vllm:num_requests_running, llamacpp:requests_processing,
              sglang:num_running_reqs, tgi_batch_current_size
    waiting   vllm:num_requests_waiting, llamacpp:requests_deferred,
              sglang:num_queue_reqs, tgi_queue_size
    kv        vllm:kv_cache_usage_perc (older vLLM: vllm:gpu_cache_usage_perc),
              llamacpp:kv_cache_usage_ratio, sglang:token_usage -- all 0..1
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

# ours -> names in preference order (a server publishing both vLLM KV names: the newer)
NAMES: Dict[str, Tuple[str, ...]] = {
    "running": ("vllm:num_requests_running", "llamacpp:requests_processing",
                "sglang:num_running_reqs", "tgi_batch_current_size"),
    "waiting": ("vllm:num_requests_waiting", "llamacpp:requests_deferred",
                "sglang:num_queue_reqs", "tgi_queue_size"),
    "kv": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
           "llamacpp:kv_cache_usage_ratio", "sglang:token_usage"),
}
# Counts add up over label sets (several engines / data-parallel ranks behind one
# endpoint); a usage fraction is averaged so that it stays a fraction.
_MEAN = {"kv"}

# name{labels} value [timestamp]; label values may hold escaped quotes and braces
_SAMPLE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(\{(?:[^"}]|"(?:[^"\\]|\\.)*")*\})?'
                     r'\s+(\S+)(?:\s+\S+)?\s*$')


def parse_prometheus(text: str) -> Dict[str, List[float]]:
    """{metric name: [value per label set]} from Prometheus text exposition format.

    Comments (# HELP / # TYPE), blank lines and malformed lines are skipped; values
    that are not finite numbers (NaN, +Inf) are dropped."""
    out: Dict[str, List[float]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        try:
            v = float(m.group(3))
        except ValueError:
            continue
        if math.isfinite(v):
            out.setdefault(m.group(1), []).append(v)
    return out


@dataclass(frozen=True)
class ServerLoad:
    """What the server said about itself; None where it publishes nothing."""

    running: Optional[float] = None
    waiting: Optional[float] = None
    kv_fraction: Optional[float] = None  # 0..1 of the server's KV cache in use
    source: Optional[str] = None  # "vllm", "llamacpp", "sglang", "tgi"

    @property
    def reported(self) -> bool:
        return self.source is not None


def server_load(text: str) -> ServerLoad:
    """The gauges this module knows, read from one `/metrics` page."""
    samples = parse_prometheus(text)
    got, source = {}, None
    for ours, names in NAMES.items():
        for name in names:
            vals = samples.get(name)
            if vals:
                got[ours] = sum(vals) / len(vals) if ours in _MEAN else sum(vals)
                source = source or _source(name)
                break
    if "kv" in got:
        got["kv"] = min(max(got["kv"], 0.0), 1.0)
    return ServerLoad(got.get("running"), got.get("waiting"), got.get("kv"), source)


def _source(name: str) -> str:
    return name.split(":", 1)[0] if ":" in name else name.split("_", 1)[0]
