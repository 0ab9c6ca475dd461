"""mlx-lm adapter directories: read and check one before an engine serves it.

An adapter directory is what `mlx_lm.lora` writes: `adapter_config.json` (its
`fine_tune_type`, `lora_parameters` with `rank` and `scale`, `num_layers`) and
`adapters.safetensors` (per adapted linear `<path>.lora_a` [in, r], `<path>.lora_b`
[r, out], and for DoRA `<path>.m` [out]). A full fine-tune holds whole weights, not a
low-rank update: it is a model of its own, so it is refused here.

`read_adapter` only reads and checks the files (on any thread: the arrays it makes
are evaluated before it returns and handed over whole); fitting them to a model's
layers is `core/worker/adapters.py`'s job.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict

__all__ = ["AdapterError", "AdapterFiles", "read_adapter", "check_adapter_name",
           "BASE", "CONFIG", "WEIGHTS"]

CONFIG, WEIGHTS = "adapter_config.json", "adapters.safetensors"
BASE = "base"  # the name of "no adapter" (a sweep's --adapter base,ft1)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]{0,63}")  # whole names only (fullmatch)
_LEAVES = ("lora_a", "lora_b", "m")


class AdapterError(ValueError):
    """An adapter that cannot be served; the message (one line) says why and what to do."""


@dataclass
class AdapterFiles:
    """One adapter as read from its directory (arrays evaluated)."""

    path: str
    kind: str  # "lora" or "dora"
    scale: float
    rank: int
    # module path in the model ("model.layers.0.self_attn.q_proj") -> {leaf: array}
    layers: Dict[str, dict] = field(default_factory=dict)
    nbytes: int = 0
    config: dict = field(default_factory=dict)


def check_adapter_name(name) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise AdapterError(
            f"an adapter name must be a short identifier (letters, digits, _ . -; "
            f"starting with a letter or _), got {name!r}")
    if name == BASE:
        raise AdapterError(f"'{BASE}' names the model without an adapter; pick "
                           "another name for this adapter")
    return name


def _config(path: Path) -> dict:
    f = path / CONFIG
    if not f.is_file():
        raise AdapterError(f"{path} has no {CONFIG}; pass the directory mlx_lm.lora "
                           "wrote with --adapter-path")
    try:
        cfg = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"{f} is not readable JSON ({type(e).__name__}: "
                           f"{' '.join(str(e).split())[:120]})") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"{f} must hold a JSON object, got {type(cfg).__name__}")
    return cfg


def read_adapter(path) -> AdapterFiles:
    """Read and check an mlx-lm adapter directory (AdapterError if it cannot serve)."""
    import mlx.core as mx

    p = Path(os.path.expanduser(os.fspath(path)))
    if not p.is_dir():
        raise AdapterError(f"no adapter directory at {str(path)!r}: pass the directory "
                           f"holding {CONFIG} and {WEIGHTS}")
    cfg = _config(p)
    kind = cfg.get("fine_tune_type", "lora")
    if kind == "full":
        raise AdapterError(f"{p} is a full fine-tune (whole weights, not a low-rank "
                           "adapter); load it as a model of its own (Engine(path) after "
                           "saving it with mlx_lm.fuse, or %mlxnb load PATH)")
    if kind not in ("lora", "dora"):
        raise AdapterError(f"{p}: fine_tune_type {kind!r} is not served; mlxnb serves "
                           "'lora' and 'dora' adapters")
    lp = cfg.get("lora_parameters")
    if not isinstance(lp, dict) or "scale" not in lp:
        raise AdapterError(f"{p}/{CONFIG} has no lora_parameters.scale (mlx-lm's LoRA "
                           "scale; mlx-lm refuses it too)")
    scale = lp["scale"]
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise AdapterError(f"{p}: lora_parameters.scale must be a finite number, got "
                           f"{scale!r}")
    wf = p / WEIGHTS
    if not wf.is_file():
        raise AdapterError(f"{p} has no {WEIGHTS}; train it first (mlx_lm.lora "
                           "writes it at the end of training)")
    try:
        weights = mx.load(str(wf))
        mx.eval(weights)
    except Exception as e:
        raise AdapterError(f"{wf} is not a readable safetensors file ({type(e).__name__}: "
                           f"{' '.join(str(e).split())[:120]})") from None
    layers: Dict[str, dict] = {}
    for name, w in weights.items():
        mod, _, leaf = name.rpartition(".")
        if leaf not in _LEAVES or not mod:
            raise AdapterError(f"{wf} holds {name!r}, which is not a LoRA/DoRA weight "
                               "(lora_a, lora_b, m); is it an adapter mlx_lm.lora wrote?")
        layers.setdefault(mod, {})[leaf] = w
    if not layers:
        raise AdapterError(f"{wf} holds no adapter weights")
    ranks = set()
    for mod, d in layers.items():
        need = ("lora_a", "lora_b", "m") if kind == "dora" else ("lora_a", "lora_b")
        missing = [k for k in need if k not in d]
        if missing:
            raise AdapterError(f"{wf}: {mod} lacks {', '.join(missing)} (a {kind} "
                               "adapter needs " + ", ".join(need) + ")")
        if kind == "lora" and "m" in d:
            raise AdapterError(f"{wf}: {mod} has a DoRA magnitude 'm' but the config "
                               "says fine_tune_type 'lora'")
        a, b = d["lora_a"], d["lora_b"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
            raise AdapterError(
                f"{wf}: {mod} has lora_a {tuple(a.shape)} and lora_b {tuple(b.shape)}; "
                "expected [in, r] and [r, out] (mixture-of-experts and embedding "
                "adapters are not served)")
        if "m" in d and tuple(d["m"].shape) != (b.shape[1],):
            raise AdapterError(f"{wf}: {mod} has m {tuple(d['m'].shape)}, expected "
                               f"({b.shape[1]},)")
        ranks.add(a.shape[1])
    return AdapterFiles(str(p), kind, float(scale), max(ranks), layers,
                        sum(w.nbytes for w in weights.values()), cfg)
