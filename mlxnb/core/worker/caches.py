"""Batched caches of every kind mlx-lm's models create, and what each costs.

A model's `make_prompt_cache` gives one cache per layer; the kinds batch as follows
(left padding is how rows of different lengths share one decode batch):

    KVCache           -> LeanBatchKVCache        keys/values grow with length
    QuantizedKVCache  -> BatchQuantizedKVCache   the same, stored as mx.quantize triplets
    RotatingKVCache   -> LeanBatchRotatingKVCache  capped at its window (windows.py)
    QuantizedRotatingKVCache -> BatchQuantizedRotatingKVCache  the same, quantized
    ArraysCache       -> ArraysCache             (mlx-lm) fixed-size recurrent state per row
    CacheList         -> CacheList of the above

A recurrent state (SSM, short conv, linear attention) has no positions to pad: a
prefill group right-pads its prompts and mlx-lm's models mask the padded steps out of
the state (`ArraysCache.prepare(lengths=...)`), so each row's state stops at its own
last token; in decode every row steps its own state. Everything else is refused by
name (`unsupported`).
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional

import mlx.core as mx

from mlx_lm.models.cache import (ArraysCache, BatchKVCache, BatchRotatingKVCache,
                                 CacheList, KVCache, QuantizedKVCache, RotatingKVCache,
                                 create_attention_mask, make_prompt_cache)

from .kv_attention import DenseKV
from .quantized_kv import (BatchQuantizedKVCache, BatchQuantizedRotatingKVCache,
                           QuantizedRotatingKVCache)
from .quantized_kv import round_up  # noqa: F401  (prefill's widths grow as caches do)
from .roll import finalize_padding
from .windows import AlignedWindow, LeanBatchRotatingKVCache

KV_BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize takes
KV_GROUP_SIZES = (32, 64, 128)


def make_row_cache(model, kv_bits: Optional[int] = None, kv_group_size: int = 64,
                   attention="quantized") -> list:
    """The model's own prompt cache, with every KV layer (full attention and sliding
    window) quantized when `kv_bits` is set, from the first token: quantization is
    per token and per group of `kv_group_size` head dims, so a row's KV bytes do not
    depend on how its prompt was chunked or batched. `attention`: how attention reads
    it (quantized_kv._Quantized)."""
    cache = make_prompt_cache(model)
    if kv_bits is None:
        return cache

    def q(c):
        if type(c) is KVCache:
            return BatchQuantizedKVCache([0], kv_group_size, kv_bits, attention)
        if type(c) is RotatingKVCache and c.keep == 0:
            return QuantizedRotatingKVCache(c.max_size, kv_group_size, kv_bits, attention)
        if type(c) is CacheList:
            return CacheList(*(q(x) for x in c.caches))
        return c

    return [q(c) for c in cache]


def sized_states(a: list, b: list, na: int, nb: int) -> None:
    """Before a's layers extend() by b's (na and nb rows): give a recurrent layer
    that holds no state on one side (a group of one-token prompts runs no prefill
    forward) zeros for its rows, shaped as the other side's. mlx-lm's extend sizes
    the zeros it fills in by batch_size, which an ArraysCache without state or
    padding reports as 1."""
    for x, y in zip(leaves(a), leaves(b)):
        if not isinstance(x, ArraysCache):
            continue
        for side, other, n in ((x, y, na), (y, x, nb)):
            if all(s is None for s in side.cache) and any(s is not None for s in other.cache):
                side.cache = [None if s is None else mx.zeros((n,) + s.shape[1:], s.dtype)
                              for s in other.cache]
        # A state that grows with the tokens seen up to a bound (LongCat's n-gram
        # context, [B, min(seen, n - 1)]): the shorter side's missing history is
        # token 0 on the left, as the model's own shift fills it
        for i, (s, t) in enumerate(zip(x.cache, y.cache)):
            if s is None or t is None or s.ndim != 2 or s.shape[1] == t.shape[1]:
                continue
            w = max(s.shape[1], t.shape[1])
            x.cache[i], y.cache[i] = (mx.pad(u, [(0, 0), (w - u.shape[1], 0)]) for u in (s, t))


def leaves(cache: list) -> list:
    """A model's per-layer caches with every CacheList opened (its parts, in order)."""
    out = []
    for c in cache:
        out.extend(leaves(c.caches) if type(c) is CacheList else [c])
    return out


_BATCHABLE = (KVCache, QuantizedKVCache, RotatingKVCache, ArraysCache)  # (+ below)


def unsupported(cache: list) -> List[str]:
    """Names of the cache kinds in `cache` that cannot batch."""
    return sorted({type(c).__name__ for c in leaves(cache) if type(c) not in _BATCHABLE})


class LayerCost(NamedTuple):
    per_token: int  # bytes one row's cache grows by per token
    window: Optional[int]  # a sliding layer's window (None: grows with length)
    fixed: int  # bytes one row holds at any length (a recurrent state)


def layer_costs(cache: list) -> List[LayerCost]:
    """Per cache leaf, read off a cache that has run a 1-token forward: KV layers
    grow per token (up to the window of a sliding layer), recurrent layers hold a
    fixed state per row."""
    out = []
    for c in leaves(cache):
        if type(c) is ArraysCache:
            out.append(LayerCost(0, None, c.nbytes))
            continue
        keys = c.keys[0] if isinstance(c.keys, (tuple, list)) else c.keys
        window = c.max_size if isinstance(c, RotatingKVCache) else None
        out.append(LayerCost(c.nbytes // keys.shape[2], window, 0))
    return out


def describe(cache: list, kv_bits: Optional[int] = None, attention="quantized",
             why: str = "") -> str:
    """What a user reads in the status line: e.g. '24 recurrent-state + 8 attention
    layers, KV 4-bit'; with quantized KV, how attention reads it (and `why` it is
    dequantized, when a check said so)."""
    counts = {}
    for c in cache:
        kinds = sorted({_KIND[type(x)] for x in leaves([c]) if type(x) in _KIND})
        name = " & ".join(kinds) or type(c).__name__
        if isinstance(c, RotatingKVCache):
            name = f"sliding-window ({c.max_size})"
        counts[name] = counts.get(name, 0) + 1
    parts = [f"{n} {k}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1])]
    text = " + ".join(parts) + " layers"
    if kv_bits is not None:
        text += f", KV {kv_bits}-bit"
        if attention == "fused":
            text += " (decode attention: fused quantized-KV kernel)"
        elif attention in ("dequantized", False):
            text += " (dequantized for attention on this device"
            text += f": {why})" if why else ")"
        if any(type(x) is RotatingKVCache for x in leaves(cache)):
            text += " (windows that keep their first tokens stay full precision)"
    return text


_KIND = {KVCache: "attention", QuantizedKVCache: "attention",
         RotatingKVCache: "sliding-window", ArraysCache: "recurrent-state"}


# -- batches --------------------------------------------------------------------------

def empty_batch(row_cache: list, n: int) -> list:
    """A fresh, empty batch cache for `n` rows, layer for layer like `row_cache`."""
    def one(c):
        t = type(c)
        if t is KVCache:
            return LeanBatchKVCache([0] * n)
        if t is QuantizedKVCache:
            return BatchQuantizedKVCache([0] * n, c.group_size, c.bits)
        if t is BatchQuantizedKVCache:
            return BatchQuantizedKVCache([0] * n, c.q_group, c.q_bits, c.attention)
        if t is RotatingKVCache:
            return LeanBatchRotatingKVCache(c.max_size, [0] * n)
        if t is QuantizedRotatingKVCache:
            return BatchQuantizedRotatingKVCache(c.max_size, [0] * n, c.q_group, c.q_bits,
                                                 c.attention)
        if t is ArraysCache:
            return ArraysCache(len(c.cache))  # no left padding: no mask in decode
        if t is CacheList:
            return CacheList(*(one(x) for x in c.caches))
        raise ValueError(f"{t.__name__} cannot batch")

    return [one(c) for c in row_cache]


def merge_lean(layers: list) -> list:
    """mlx-lm's merge of single-row caches, per layer ([[row caches] per layer]), into
    batch caches; each BatchKVCache becomes a LeanBatchKVCache, as the decode batch
    that takes these buffers over needs."""
    out = [type(rows[0]).merge(rows) for rows in layers]
    for c in out:
        if type(c) is BatchKVCache:
            c.__class__ = LeanBatchKVCache
        elif type(c) is BatchRotatingKVCache:
            LeanBatchRotatingKVCache.lean(c)
    return out


def aligned_views(caches: list, windows: bool = False) -> list:
    """What the model sees of a batch none of whose rows is left-padded: KV layers as
    AlignedViews; with `windows` (a decode batch, whose rows all hold what its KV
    layers hold) sliding windows as AlignedWindows (windows.py); everything else
    as is."""
    kv = next((c for c in caches if type(c) in _ALIGNABLE), None) if windows else None
    return [AlignedView(c) if type(c) in _ALIGNABLE
            else AlignedWindow(c, kv._idx)
            if kv is not None and type(c) is LeanBatchRotatingKVCache
            else c for c in caches]


def left_padded(caches: list) -> bool:
    """Is any row of this batch left-padded in its (full-attention) KV layers? Rows
    join all layers together, so one layer tells."""
    for c in caches:
        if type(c) in _ALIGNABLE:
            return max(c.left_padding.tolist()) > 0
    return False


class LeanBatchKVCache(BatchKVCache):
    """mlx-lm's BatchKVCache with `offset` derived (= _idx - left_padding, an
    invariant of every method) instead of stored: its per-layer `offset + 1` update
    each decode step becomes a node nobody evaluates.

    It also grows its buffers 255 tokens at a time, not 256. MLX's CUDA backend sends
    single-token attention over a buffer whose length is a multiple of 256 to cuDNN
    (mlx/backend/cuda/scaled_dot_product_attention.cpp, use_cudnn_for_decoding),
    which builds a graph per (batch size, buffer length): measured ~100 ms each time
    a row leaves or joins, and ~2 ms slower per step than the vector kernel at batch
    64. Any other length keeps decode on the vector kernel;
    other backends don't care."""

    step = 255
    # kv_attention.py: one token's attention over a padded batch goes to its fused
    # kernel (set at load where it checked out: CUDA); `bits` tells mlx-lm to route it
    dense_decode = False
    _dense_now = False

    @property
    def offset(self):
        return self._idx - self.left_padding

    @offset.setter
    def offset(self, value):
        pass

    @property
    def bits(self):
        if not self._dense_now:
            raise AttributeError("bits")
        return 16

    @property
    def group_size(self):
        if not self._dense_now:
            raise AttributeError("group_size")
        return 0

    finalize = finalize_padding  # (roll.py: a gather of [D] vectors)

    def update_and_fetch(self, keys, values):
        k, v = self.write(keys, values)
        self._dense_now = self.dense_decode and keys.shape[2] == 1
        if self._dense_now:
            return DenseKV((k,)), DenseKV((v,))
        return k, v

    def write(self, keys, values):
        """Store [B, H, n, D] keys and values; their buffers' first positions up to
        the new end (views)."""
        self._dense_now = False
        prev, n = self._idx, keys.shape[2]
        if self.keys is None or prev + n > self.keys.shape[2]:
            # growth: mlx-lm's path
            return BatchKVCache.update_and_fetch(self, keys, values)
        # mlx-lm's write without its `offset += n`, which on this class builds two
        # array ops per layer per step that nothing evaluates
        self._idx = prev + n
        self.keys[..., prev:self._idx, :] = keys
        self.values[..., prev:self._idx, :] = values
        return self.keys[..., :self._idx, :], self.values[..., :self._idx, :]


_BATCHABLE += (QuantizedRotatingKVCache, BatchQuantizedKVCache)
_KIND[QuantizedRotatingKVCache] = "sliding-window"
_KIND[BatchQuantizedKVCache] = "attention"
_ALIGNABLE = (LeanBatchKVCache, BatchQuantizedKVCache)


class AlignedView:
    """Stand-in for a batch cache none of whose rows is left-padded (a decode batch
    that joined together, or a fresh prefill group, right-padded): a plain KVCache
    to the model -- scalar RoPE offset and no mask array ("causal" for a chunk), so
    attention takes the same fused path as an unbatched loop. Mask arrays also cost
    a per-shape setup on some backends (measured ~80 ms per prefill on CUDA).
    Anything else (bits, group_size, keys...) reads through to the cache."""

    __slots__ = ("c",)

    def __init__(self, c):
        self.c = c

    @property
    def offset(self):
        return self.c._idx

    def update_and_fetch(self, keys, values):
        c = self.c
        if type(c) is LeanBatchKVCache:  # unpadded: MLX's attention, no mask, is fast
            return c.write(keys, values)
        return c.update_and_fetch(keys, values)

    def make_mask(self, N, return_array: bool = False, window_size=None, **kwargs):
        # mlx-lm's single-row rule (KVCache.make_mask): arrays only when asked for
        return create_attention_mask(N, self.c._idx, return_array, window_size)

    def __getattr__(self, name):
        return getattr(self.c, name)


def chunk_lengths(cache: list, lengths: List[int]) -> None:
    """Before a chunk of a padded prefill: each row's real tokens within the chunk,
    for the recurrent layers (ArraysCache, also inside a CacheList). mlx-lm's
    `prepare` sets the whole prompt's lengths, and mlx-lm's SSM attention (Mamba-2
    and kin) reads each row's last decay at index min(length, chunk) - 1 of the
    chunk: past its end for a row longer than the chunk."""
    for c in cache:
        for leaf in (c.caches if isinstance(c, CacheList) else (c,)):
            if isinstance(leaf, ArraysCache) and leaf.lengths is not None:
                leaf.lengths = mx.array(lengths)  # one each: advance() subtracts in place
