"""What a load measures of a model before any row runs on it: does padding stay out
of a row's logits (`padding_stays_out`), and do compiled decode steps compute what
the plain ones do (`decode_steps_agree`). Each runs the model itself, on the worker,
at the load's start (setup.py)."""

from __future__ import annotations

from typing import List

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, make_prompt_cache

from .caches import aligned_views, empty_batch
from .tokens import TOKEN, ids as tokens_of


def _diff(a, b) -> float:
    return (a.astype(mx.float32) - b.astype(mx.float32)).abs().max().item()


def padding_stays_out(model, make_cache, ids: List[int]) -> bool:
    """How padding behaves in this model, measured at load: a 3-token row's first
    decode logits alone, beside another 3-token row (no padding: the noise of a
    batch shape change alone), beside an 11-token row it joined (left-padded in
    decode) and right-padded in a prefill group with it (4-token chunks, so a
    chunk can be all padding for it). Masked padding keeps the padded cases within
    the noise; measured leaks are far outside it (tiny random models: 2-3% of the
    logit range for a recurrent state that decays over padded steps, 8-25% for
    layers that take positions from the buffer length; dtype noise on an H200 in
    bf16 was the same with and without padding).

    Left padding outside the noise, or a padded batch that fails, refuses the model
    (ValueError). Right padding beyond the batch-shape noise plus the dtype's
    rounding (1e-4 of the logit scale in float32, 0.005 in 16 bits) returns False: mlx-lm's recurrent layers
    mostly mask padded steps out of their state (`ArraysCache.lengths`), but some
    let them in, and those rows must prefill unpadded."""
    try:
        alone, pair, beside, padded = padding_graphs(model, make_cache, ids)
        mx.eval(alone, pair, beside, padded)
    except Exception as e:
        raise ValueError(f"mlxnb cannot batch this model: a padded batch fails in its "
                         f"forward ({type(e).__name__}: {' '.join(str(e).split())[:160]})."
                         f" Use mlx_lm.generate for it.") from None
    scale, shape_noise = max(1.0, alone.abs().max().item()), 4 * _diff(pair, alone)
    noise = shape_noise + 0.005 * scale
    if _diff(beside, alone) > noise:
        raise ValueError("mlxnb cannot batch this model: a row's output changes when "
                         "it shares a batch with longer rows (left padding reaches its "
                         "attention or positions). Use mlx_lm.generate for it.")
    # A wrong "safe" here changes a row's tokens, a wrong "unsafe" only prefills
    # it alone: the floor is the dtype's rounding, not the refusal's (float32 leaks
    # of 4e-3 went under that one)
    floor = 1e-4 if alone.dtype == mx.float32 else 0.005
    return _diff(padded, alone) <= shape_noise + floor * scale


def padding_graphs(model, make_cache, ids: List[int]) -> tuple:
    """`padding_stays_out`'s four first-decode logits, built and not evaluated:
    (alone, beside a row of the same length, beside a longer row it joined,
    right-padded in a prefill group with it)."""
    ids = (list(ids) * 14)[:14] if ids else list(range(2, 16))
    short, longer, other = ids[:3], ids[3:14], ids[4:7]

    def prefill(rows, chunk=4):
        width = max(map(len, rows))
        cache = empty_batch(make_cache(), len(rows))
        pad = [width - len(r) for r in rows]
        if max(pad):
            for c in cache:
                c.prepare(lengths=[len(r) for r in rows], right_padding=pad)
        tokens = tokens_of([r + [0] * p for r, p in zip(rows, pad)])
        views = aligned_views(cache)
        for i in range(0, width, chunk):
            model(tokens[:, i:i + chunk], cache=views)
        if max(pad):
            for c in cache:
                c.finalize()
        return cache

    def step(cache, n):
        return model(tokens_of([ids[:1]] * n), cache=cache)[0, -1]

    alone = step(aligned_views(prefill([short])), 1)
    pair = step(aligned_views(prefill([short, other])), 2)
    joined = prefill([short])
    for c, o in zip(joined, prefill([longer])):
        c.extend(o)
    beside = step(joined, 2)
    return alone, pair, beside, step(prefill([short, longer]), 2)


def probe_ids(tokenizer) -> List[int]:
    """Token ids of ordinary text, for probe forwards (any ids if the tokenizer
    cannot encode it)."""
    try:
        return [int(t) for t in tokenizer.encode(
            "The quick brown fox jumps over the lazy dog, again and again.")]
    except Exception:
        return []


def probe_forwards(model, cache) -> None:
    """The load's first forwards (setup.py's cache probes): a token, a chunk, a
    decode step, into `cache`; not evaluated."""
    for n in (1, 5, 1):
        model(mx.zeros((1, n), TOKEN), cache=cache)


def load_forwards(model, make_cache, ids: List[int]) -> list:
    """The load's forwards (probes, padded batches) as builders, for calls_ahead.py's
    survey of what they compile."""
    return [lambda: probe_forwards(model, make_cache()),
            lambda: padding_graphs(model, make_cache, ids)]


def decode_steps_agree(model, ids: List[int], switch: list) -> str:
    """Three decode steps of two rows with the compiled recurrent steps (switch[0]
    True) and without: '' if logits and states agree within dtype noise, else what
    differs. A trace that dropped a side effect of the layer's code, or baked in a
    value that changes per step, shows up here."""
    ids = (list(ids) * 10)[:10] if ids else list(range(2, 12))

    def run(on: bool):
        switch[0] = on
        cache = make_prompt_cache(model)
        model(tokens_of([ids[:5], ids[5:]]), cache=cache)
        steps = [model(tokens_of([[ids[i]], [ids[-1 - i]]]), cache=cache)[:, -1]
                 for i in range(3)]
        states = [x for c in cache if type(c) is ArraysCache for x in c.cache]
        mx.eval(steps, states)
        return steps, states

    try:
        plain, compiled = run(False), run(True)
    except Exception as e:
        return f"compiled decode failed: {type(e).__name__}: {' '.join(str(e).split())[:120]}"
    finally:
        switch[0] = True
    for a, b in zip(plain[0] + plain[1], compiled[0] + compiled[1]):
        scale = max(1.0, a.astype(mx.float32).abs().max().item())
        if not _diff(a, b) <= 0.02 * scale:
            return "compiled decode steps differ from the plain ones"
    return ""
