"""The Engine's constructor arguments, checked before anything loads: each refusal is
one line that names the argument and what it takes."""

from __future__ import annotations

import asyncio
from numbers import Integral, Real

from .._text import one_line
from .worker.caches import KV_BITS, KV_GROUP_SIZES


def _positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _integral(v) -> bool:  # (4.0 == 4, but MLX's quantize takes ints only)
    return isinstance(v, Integral) and not isinstance(v, bool)


def _seconds(v) -> bool:
    return isinstance(v, Real) and not isinstance(v, bool) and v == v


def check_options(*, max_batch, prefill_chunk, kv_bits, kv_group_size, load_timeout,
                  streak_s, fill_threads, speculate=None, draft_model=None,
                  loop=None) -> None:
    """Raise ValueError for the first argument an Engine cannot run with."""
    checks = [
        ("max_batch", max_batch, _positive_int(max_batch), "a positive integer"),
        ("prefill_chunk", prefill_chunk,
         prefill_chunk is None or _positive_int(prefill_chunk),
         "a positive integer or None (auto)"),
        ("kv_bits", kv_bits, kv_bits is None or (_integral(kv_bits) and kv_bits in KV_BITS),
         f"one of {', '.join(map(str, KV_BITS))} or None (full-precision KV)"),
        ("kv_group_size", kv_group_size,
         _integral(kv_group_size) and kv_group_size in KV_GROUP_SIZES,
         f"one of {', '.join(map(str, KV_GROUP_SIZES))}"),
        ("load_timeout", load_timeout,
         load_timeout is None or (_seconds(load_timeout) and load_timeout > 0),
         "a positive number of seconds or None (no limit)"),
        ("streak_s", streak_s, _seconds(streak_s) and 0 <= streak_s < float("inf"),
         "a finite number of seconds >= 0 (how long the loop may wait for tokens)"),
        ("fill_threads", fill_threads, fill_threads is None or _positive_int(fill_threads),
         "a positive integer or None (auto)"),
        ("speculate", speculate, speculate in (None, "lookup", "draft"),
         "'lookup', 'draft' or None (no speculation)"),
        ("draft_model", draft_model, draft_model is None or not isinstance(
            draft_model, (bool, int, float, bytes)) and (
            not isinstance(draft_model, (tuple, list)) or len(draft_model) == 2),
         "a model (a name or path, a loaded model or (model, tokenizer)), "
         "'layers:N' or None"),
        ("loop", loop, loop is None or isinstance(loop, asyncio.AbstractEventLoop),
         "an asyncio event loop or None (the running one)"),
    ]
    for name, value, ok, what in checks:
        if not ok:
            raise ValueError(f"{name} must be {what}, got {one_line(repr(value), 60)}")
    if speculate == "draft" and draft_model is None:
        raise ValueError("speculate='draft' needs a draft model: pass draft_model= "
                         "(a model sharing the tokenizer, or 'layers:N')")
