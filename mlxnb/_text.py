"""What messages and checks share: one-line text, byte sizes, parameter ranges.

Kept here once so that the engine, the magics and the widget say the same thing the
same way (an error message never spans lines; "2GB" means 2 GiB everywhere; a range
refused by `%%generate` is the one `Engine.submit` refuses).
"""

from __future__ import annotations

import math
from typing import Optional


def one_line(text, n: int) -> str:
    """`text` on one line (runs of whitespace become one space), at most n characters;
    an exception without a message reads as its type's name."""
    s = " ".join(str(text).split())
    if not s and isinstance(text, BaseException):
        s = type(text).__name__
    return s if len(s) <= n else s[: n - 1] + "…"


def fmt_bytes(n) -> str:
    """Binary units, like the "2GB" budgets parse_bytes reads: 1536 -> '1.5 KB'."""
    n = float(n or 0)
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def parse_bytes(v, name: str = "kv_budget") -> Optional[int]:
    """'2GB', '512MB', 1e9, None -> bytes (None = no limit); `name` is the
    parameter the errors name."""
    if v is None:
        return None
    if isinstance(v, (int, float)):
        if v == math.inf:  # as the string 'inf'
            return None
        if math.isnan(v):
            raise ValueError(f"cannot read {v!r} as a size; write e.g. '2GB', or None "
                             "for no limit")
        if v <= 0:
            raise ValueError(f"{name} must be positive, got {v!r}")
        return int(v)
    s = str(v).strip().upper().replace(" ", "")
    if s in ("NONE", "INF", "UNLIMITED"):
        return None
    units = {"TB": 1 << 40, "GB": 1 << 30, "MB": 1 << 20, "KB": 1 << 10, "B": 1,
             "T": 1 << 40, "G": 1 << 30, "M": 1 << 20, "K": 1 << 10}
    for u in sorted(units, key=len, reverse=True):
        if s.endswith(u):
            num = s[: -len(u)]
            break
    else:
        u, num = "B", s
    try:
        n = float(num)
    except ValueError:
        n = math.nan
    if not math.isfinite(n):
        raise ValueError(f"cannot read {v!r} as a size; write e.g. '2GB' or '512MB'")
    if n <= 0:
        raise ValueError(f"{name} must be positive, got {v!r}")
    return int(n * units[u])


# Parameter -> (test, what a valid value is). SamplingParams.check applies these to
# every row; `%%generate` applies them to each option value with an example added.
# Types are checked before (a test assumes a number of the right kind).
RANGES = {
    "max_tokens": (lambda v: v >= 1, "a positive integer"),
    "temperature": (lambda v: v >= 0, "a number >= 0 (0 = greedy)"),
    "top_p": (lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "top_k": (lambda v: v >= 0, "an integer >= 0 (0 = off)"),
    "min_p": (lambda v: 0 <= v < 1, "a number in [0, 1)"),
    "repetition_penalty": (lambda v: v > 0, "a number > 0"),
    # the sampler keys its random stream on 32 bits: a larger seed would repeat one
    "seed": (lambda v: 0 <= v < 1 << 32, "an integer in [0, 2**32)"),
    "logprobs": (lambda v: 0 <= v <= 20, "an integer in [0, 20]"),
    "n": (lambda v: v >= 1, "a positive integer"),
    "num_draft": (lambda v: 0 <= v <= 16, "an integer in [0, 16] (0 = adaptive)"),  # samples per prompt (%%generate)
}
