"""The speculative-sampling rule for draft-model proposals, on the device.

A row that draws (temperature > 0) proposes draft token x_j ~ q_j, the draft model's
distribution at position j under the row's own temperature and truncation filters.
The target keeps x_j with probability min(1, p_j(x_j) / q_j(x_j)), p_j being the
distribution the row draws from at position j (sampling.py: its filtered, tempered
softmax); at the first rejection it takes a token from max(0, p_j - q_j),
renormalised, and stops; after k kept drafts it takes position k's own draw. Each
token then has distribution p_j exactly (Leviathan et al., 2023), whatever q is.

Every uniform comes from the row's counter-based hash (sampling.py), keyed by the
row's seed, the token index and a stream of its own (proposal, acceptance,
residual), so a seeded row draws the same tokens alone or in any batch, provided
its drafting schedule is its own (draft.py: each row's draft length depends only on
its own history). Greedy rows propose the draft's argmax and keep it while it equals
the target's argmax: the plain argmax rule, which `accept_drafts` already applies.
"""

from __future__ import annotations

from typing import Dict, Tuple

import mlx.core as mx

from .sampling import _GOLDEN, _M2, _apply_filters, _fmix32, _u32, gumbel_noise

__all__ = ["draft_draw", "reject_sample", "uniforms", "PROPOSE", "ACCEPT", "RESIDUAL"]

# stream keys xor-ed into the row's seed: each use of randomness has its own hash
PROPOSE, ACCEPT, RESIDUAL = 0x6A09E667, 0xBB67AE85, 0x3C6EF372


def vocab_keys(V: int) -> mx.array:
    return mx.arange(V, dtype=mx.uint32) * _u32(_M2)


def uniforms(seeds: mx.array, counters: mx.array) -> mx.array:
    """Uniform (0, 1) float32 [N] from seeds [N] and counters [N] (uint32)."""
    key = _fmix32((seeds ^ _u32(ACCEPT)) ^ _fmix32(counters * _u32(_GOLDEN) + _u32(0x2545F491)))
    return (key.astype(mx.float32) + 0.5) * (2.0 ** -32)


def filtered_logq(logits: mx.array, temps: mx.array,
                  groups: Dict[tuple, Tuple[mx.array, int]]) -> mx.array:
    """log q [N, V]: logits [N, V] with each row's truncation filters (groups: as
    BatchSampler's, rows by filters) and temperature (rows at 0 get T = 1)."""
    x = logits.astype(mx.float32)
    for (k, p, m), (idx, n) in groups.items():
        rows = x if n == x.shape[0] else x[idx]
        lp = _apply_filters(rows - mx.logsumexp(rows, axis=-1, keepdims=True), k, p, m)
        if n == x.shape[0]:
            x = lp
        else:
            x[idx] = lp
    z = x / mx.where(temps > 0, temps, 1.0)[:, None]
    return z - mx.logsumexp(z, axis=-1, keepdims=True)


def draft_draw(logits: mx.array, temps: mx.array, groups, seeds: mx.array,
               counters: mx.array, keys: mx.array, sampled: bool):
    """One draft position for every draft row: logits [N, V] -> (tokens [N] uint32,
    log q [N, V] or None when no row draws). A row at temperature 0 proposes its
    argmax; a drawing row draws from q with its proposal stream."""
    greedy = mx.argmax(logits, axis=-1)  # uint32: the token type (tokens.py)
    if not sampled:
        return greedy, None
    logq = filtered_logq(logits, temps, groups)
    g = gumbel_noise(seeds ^ _u32(PROPOSE), counters, keys)
    drawn = mx.argmax(logq + g, axis=-1)
    return mx.where(temps > 0, drawn, greedy), logq


def reject_sample(logp: mx.array, logq: mx.array, drafts: mx.array, k: mx.array,
                  bonus: mx.array, seeds: mx.array, counters: mx.array, keys: mx.array):
    """The rule for S drawing rows with K draft positions each.

    logp [S, K, V]: the target's log-distribution at each draft position; logq
    [S, K, V]: the draft's, the drafts were drawn from; drafts [S, K] int32; k [S]:
    each row's number of drafts (positions >= k are padding); bonus [S]: each row's
    own draw at position k (used when all k drafts are kept); seeds [S], counters [S]
    (uint32: position j uses counter + j).
    -> (drafts kept [S] int32, the token after them [S] int32)."""
    S, K, V = logp.shape
    j = mx.arange(K, dtype=mx.uint32)
    ctr = (counters[:, None] + j[None, :]).reshape(-1)  # [S * K]
    sk = mx.repeat(seeds, K)
    d = mx.maximum(drafts, 0)[..., None]
    lp_x = mx.take_along_axis(logp, d, axis=-1)[..., 0]  # [S, K]
    lq_x = mx.take_along_axis(logq, d, axis=-1)[..., 0]
    u = uniforms(sk, ctr).reshape(S, K)
    live = mx.arange(K)[None, :] < k[:, None]
    keep = (mx.log(u) < lp_x - lq_x) & live
    acc = mx.cumprod(keep.astype(mx.int32), axis=1).sum(axis=1)  # [S]
    # the residual max(0, p - q) at every position; the first rejection's is used
    resid = mx.maximum(mx.exp(logp) - mx.exp(logq), 0.0)  # [S, K, V]
    some = resid.sum(axis=-1, keepdims=True) > 0
    # p == q to float precision leaves nothing: then p itself (it is the residual's limit)
    score = mx.where(some, mx.log(resid), logp)
    g = gumbel_noise(sk ^ _u32(RESIDUAL), ctr, keys).reshape(S, K, V)
    fix = mx.argmax(score + g, axis=-1).astype(mx.int32)  # [S, K]
    at = mx.minimum(acc, K - 1)
    fixed = mx.take_along_axis(fix, at[:, None], axis=1)[:, 0]
    nxt = mx.where(acc < k, fixed, bonus.astype(mx.int32))
    return acc, nxt
