"""Batched caches of every kind mlx-lm's models create, and what each costs.

A model's `make_prompt_cache` gives one cache per layer; the kinds batch as follows
(left padding is how rows of different lengths share one decode batch):

    KVCache           -> LeanBatchKVCache        keys/values grow with length
    QuantizedKVCache  -> BatchQuantizedKVCache   the same, stored as mx.quantize triplets
    RotatingKVCache   -> BatchRotatingKVCache    (mlx-lm) capped at its window
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

from typing import List, Optional

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import (ArraysCache, BatchKVCache, BatchRotatingKVCache,
                                 CacheList, KVCache, QuantizedKVCache, RotatingKVCache,
                                 create_attention_mask, dynamic_roll, make_prompt_cache)

KV_BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize takes
KV_GROUP_SIZES = (32, 64, 128)


def round_up(n: int, step: int) -> int:
    return -(-n // step) * step


# -- one row's cache ------------------------------------------------------------------

def make_row_cache(model, kv_bits: Optional[int] = None, kv_group_size: int = 64,
                   quantized_attention: bool = True) -> list:
    """The model's own prompt cache, with every KV layer (full attention and sliding
    window) quantized when `kv_bits` is set, from the first token: quantization is
    per token and per group of `kv_group_size` head dims, so a row's KV bytes do not
    depend on how its prompt was chunked or batched. `quantized_attention`: see
    `_Quantized`."""
    cache = make_prompt_cache(model)
    if kv_bits is None:
        return cache

    def q(c):
        if type(c) is KVCache:
            return BatchQuantizedKVCache([0], kv_group_size, kv_bits, quantized_attention)
        if type(c) is RotatingKVCache and c.keep == 0:
            return QuantizedRotatingKVCache(c.max_size, kv_group_size, kv_bits,
                                            quantized_attention)
        if type(c) is CacheList:
            return CacheList(*(q(x) for x in c.caches))
        return c

    return [q(c) for c in cache]


def _leaves(cache: list) -> list:
    out = []
    for c in cache:
        out.extend(_leaves(c.caches) if type(c) is CacheList else [c])
    return out


_BATCHABLE = (KVCache, QuantizedKVCache, RotatingKVCache, ArraysCache)  # (+ below)


def unsupported(cache: list) -> List[str]:
    """Names of the cache kinds in `cache` that cannot batch."""
    return sorted({type(c).__name__ for c in _leaves(cache) if type(c) not in _BATCHABLE})


def layer_costs(cache: list) -> List[tuple]:
    """[(bytes per token, window or None, fixed bytes)] per cache leaf, read off a
    cache that has run a 1-token forward: KV layers grow per token (up to the window
    of a sliding layer), recurrent layers hold a fixed state per row."""
    out = []
    for c in _leaves(cache):
        if type(c) is ArraysCache:
            out.append((0, None, c.nbytes))
            continue
        keys = c.keys[0] if isinstance(c.keys, (tuple, list)) else c.keys
        window = c.max_size if isinstance(c, RotatingKVCache) else None
        out.append((c.nbytes // keys.shape[2], window, 0))
    return out


def describe(cache: list, kv_bits: Optional[int] = None,
             quantized_attention: bool = True) -> str:
    """What a user reads in the status line: e.g. '24 recurrent-state + 8 attention
    layers, KV 4-bit'."""
    counts = {}
    for c in cache:
        kinds = sorted({_KIND[type(x)] for x in _leaves([c]) if type(x) in _KIND})
        name = " & ".join(kinds) or type(c).__name__
        if isinstance(c, RotatingKVCache):
            name = f"sliding-window ({c.max_size})"
        counts[name] = counts.get(name, 0) + 1
    parts = [f"{n} {k}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1])]
    text = " + ".join(parts) + " layers"
    if kv_bits is not None:
        text += f", KV {kv_bits}-bit"
        if not quantized_attention:
            text += " (dequantized for attention on this device)"
        if any(type(x) is RotatingKVCache for x in _leaves(cache)):
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
            return BatchQuantizedKVCache([0] * n, c.q_group, c.q_bits, c.quantized_attention)
        if t is RotatingKVCache:
            return BatchRotatingKVCache(c.max_size, [0] * n)
        if t is QuantizedRotatingKVCache:
            return BatchQuantizedRotatingKVCache(c.max_size, [0] * n, c.q_group, c.q_bits,
                                                 c.quantized_attention)
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
    return out


def aligned_views(caches: list) -> list:
    """What the model sees of a batch none of whose rows is left-padded: KV layers as
    AlignedViews, everything else as is."""
    return [AlignedView(c) if type(c) in _ALIGNABLE else c for c in caches]


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
    64 (bench/shape_costs.py). Any other length keeps decode on the vector kernel;
    other backends don't care."""

    step = 255

    @property
    def offset(self):
        return self._idx - self.left_padding

    @offset.setter
    def offset(self, value):
        pass

    def update_and_fetch(self, keys, values):
        prev, n = self._idx, keys.shape[2]
        if self.keys is None or prev + n > self.keys.shape[2]:
            return super().update_and_fetch(keys, values)  # growth: mlx-lm's path
        # mlx-lm's write without its `offset += n`, which on this class builds two
        # array ops per layer per step that nothing evaluates
        self._idx = prev + n
        self.keys[..., prev:self._idx, :] = keys
        self.values[..., prev:self._idx, :] = values
        return self.keys[..., :self._idx, :], self.values[..., :self._idx, :]


class _Quantized:
    """Quantization settings of a KV cache and how attention reads it. With
    `quantized_attention` the cache has `bits` and `group_size`, so mlx-lm's
    attention multiplies the mx.quantize triplets directly; without, attention gets
    them dequantized (plain attention; the memory saved is the same). The engine
    picks at load: MLX's CUDA backend, for one, has no quantized matmul for the
    shapes single-token attention needs."""

    def _quant(self, group_size: int, bits: int, quantized_attention: bool):
        self.q_group, self.q_bits = group_size, bits
        self.quantized_attention = quantized_attention

    def __getattr__(self, name):  # only for names not set on the instance
        d = self.__dict__
        if name in ("bits", "group_size") and d.get("quantized_attention"):
            return d["q_bits"] if name == "bits" else d["q_group"]
        raise AttributeError(name)

    def _for_attention(self, trip):
        if self.quantized_attention:
            return trip
        return mx.dequantize(*trip, group_size=self.q_group, bits=self.q_bits)


class BatchQuantizedKVCache(_Quantized):
    """A left-padded batch of quantized keys and values: `keys` and `values` are
    mx.quantize triplets (packed uint32, scales, biases), each [B, H, S, *]. mlx-lm
    has a single-row QuantizedKVCache only; this is its batch form (and, with one
    row, the engine's single-row form), laid out like BatchKVCache (same padding,
    filter, extend and finalize rules)."""

    step = 256

    def __init__(self, left_padding: list, group_size: int = 64, bits: int = 8,
                 quantized_attention: bool = True):
        self.keys = self.values = None
        self.left_padding = mx.array(left_padding)
        self._idx = 0
        self._right_padding = None
        self._quant(group_size, bits, quantized_attention)

    @property
    def offset(self):
        return self._idx - self.left_padding

    def update_and_fetch(self, keys, values):
        B, H, n, _ = keys.shape
        prev = self._idx
        if self.keys is None or prev + n > self.keys[0].shape[2]:
            new = round_up(n, self.step)

            def grow(old, x):
                per_int = 32 // self.q_bits
                D = x.shape[-1]
                fresh = (mx.zeros((B, H, new, D // per_int), mx.uint32),
                         mx.zeros((B, H, new, D // self.q_group), x.dtype),
                         mx.zeros((B, H, new, D // self.q_group), x.dtype))
                if old is None:
                    return fresh
                return tuple(mx.concatenate([o[..., :prev, :], f], axis=2)
                             for o, f in zip(old, fresh))

            self.keys, self.values = grow(self.keys, keys), grow(self.values, values)
        qk = mx.quantize(keys, group_size=self.q_group, bits=self.q_bits)
        qv = mx.quantize(values, group_size=self.q_group, bits=self.q_bits)
        self._idx = prev + n
        for dst, src in ((self.keys, qk), (self.values, qv)):
            for d, s in zip(dst, src):
                d[..., prev:self._idx, :] = s
        return self.keys_and_values()

    def keys_and_values(self):
        i = self._idx
        return (self._for_attention(tuple(x[..., :i, :] for x in self.keys)),
                self._for_attention(tuple(x[..., :i, :] for x in self.values)))

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        if left_padding is not None:
            if self.keys is not None:
                raise ValueError("left padding can only be added to an empty cache")
            self.left_padding = self.left_padding + mx.array(left_padding)
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = mx.array(right_padding)

    def finalize(self):
        """Right padding (a prefill group's) becomes left padding."""
        if self._right_padding is not None:
            pad = self._right_padding[:, None]
            self.keys = tuple(dynamic_roll(x, pad, axis=2) for x in self.keys)
            self.values = tuple(dynamic_roll(x, pad, axis=2) for x in self.values)
            self.left_padding = self.left_padding + self._right_padding
            self._right_padding = None

    @property
    def state(self):
        return self.keys, self.values, self.left_padding

    def make_mask(self, N: int, return_array: bool = False, **kwargs):
        return create_causal_mask(N, offset=self._idx, left_padding=self.left_padding,
                                  **kwargs)

    def filter(self, batch_indices):
        if self.keys is not None:
            self.keys = tuple(x[batch_indices] for x in self.keys)
            self.values = tuple(x[batch_indices] for x in self.values)
        self.left_padding = self.left_padding[batch_indices]
        shift = min(self.left_padding.tolist())  # drop columns every row pads
        if shift > 0:
            if self.keys is not None:
                self.keys = tuple(x[..., shift:, :] for x in self.keys)
                self.values = tuple(x[..., shift:, :] for x in self.values)
            self._idx -= shift
            self.left_padding = self.left_padding - shift

    def extend(self, other: "BatchQuantizedKVCache"):
        """Append `other`'s rows, both right-justified at the longer one's length."""
        self._gather([self, other])

    def _gather(self, parts: list):
        """Become the rows of `parts` in order (self among them), each right-justified
        at the longest one's length: one concatenation, however many parts."""
        if all(c.keys is None for c in parts):
            self.left_padding = mx.concatenate([c.left_padding for c in parts])
            return
        idx = max(c._idx for c in parts)
        held = [c for c in parts if c.keys is not None]
        ref, refv = held[0].keys, held[0].values
        size = max(c.keys[0].shape[2] for c in held)

        def pad(c):
            k, v = c.keys, c.values
            if k is None:
                b = c.left_padding.shape[0]
                k = tuple(mx.zeros((b,) + r.shape[1:2] + (0,) + r.shape[3:], r.dtype)
                          for r in ref)
                v = tuple(mx.zeros((b,) + r.shape[1:2] + (0,) + r.shape[3:], r.dtype)
                          for r in refv)
            left = idx - c._idx
            right = size - k[0].shape[2] - left
            if right < 0:
                k = tuple(x[..., :right, :] for x in k)
                v = tuple(x[..., :right, :] for x in v)
                right = 0
            if left or right:
                widths = [(0, 0), (0, 0), (left, right), (0, 0)]
                k = tuple(mx.pad(x, widths) for x in k)
                v = tuple(mx.pad(x, widths) for x in v)
            return k, v, c.left_padding + left

        ks, vs, pads = zip(*(pad(c) for c in parts))
        self.keys = tuple(mx.concatenate(list(x)) for x in zip(*ks))
        self.values = tuple(mx.concatenate(list(x)) for x in zip(*vs))
        self.left_padding = mx.concatenate(list(pads))
        self._idx = idx

    def load(self, keys, values):
        """Hold these triplets ([1, H, n, *]: one row, no padding) as its first n
        positions; a later write grows into new arrays, never into these."""
        self.keys, self.values = keys, values
        self._idx = keys[0].shape[2]

    @classmethod
    def merge(cls, rows: list) -> "BatchQuantizedKVCache":
        """One batch of these caches' rows (each right-justified, as `extend` does)."""
        rows[0]._gather(rows)
        return rows[0]

    def size(self):
        return self._idx

    def empty(self):
        return self.keys is None

    @property
    def nbytes(self):
        if self.keys is None:
            return 0
        return sum(x.nbytes for x in self.keys + self.values)


class _Packed(_Quantized):
    """Quantized KV as ONE uint32 array per tensor, [..., S, words]: the packed
    values, then the scales and biases viewed as uint32. A sliding window's cache
    rolls, trims, pads and concatenates its buffers along S (mlx-lm's rotating
    caches, unchanged); on one array those are the same operations."""

    def _pack(self, x):
        q, scales, biases = mx.quantize(x, group_size=self.q_group, bits=self.q_bits)
        sb = mx.view(mx.concatenate([scales, biases], axis=-1), mx.uint32)
        return mx.concatenate([q, sb], axis=-1)

    def _unpack(self, p, like):
        """What attention reads of `p`, which packs tensors of `like`'s head dim
        and dtype."""
        n = like.shape[-1] * self.q_bits // 32
        sb = mx.view(p[..., n:], like.dtype)
        half = sb.shape[-1] // 2
        return self._for_attention((p[..., :n], sb[..., :half], sb[..., half:]))

    def update_and_fetch(self, keys, values):
        k, v = super().update_and_fetch(self._pack(keys), self._pack(values))
        return self._unpack(k, keys), self._unpack(v, values)


class QuantizedRotatingKVCache(_Packed, RotatingKVCache):
    """mlx-lm's RotatingKVCache (a sliding window) holding quantized keys/values,
    which mlx-lm does not offer; one row, as `make_row_cache` builds it."""

    def __init__(self, max_size, group_size: int = 64, bits: int = 8,
                 quantized_attention: bool = True):
        super().__init__(max_size)
        self._quant(group_size, bits, quantized_attention)


class BatchQuantizedRotatingKVCache(_Packed, BatchRotatingKVCache):
    """mlx-lm's BatchRotatingKVCache holding quantized keys/values."""

    def __init__(self, max_size, left_padding: list, group_size: int = 64, bits: int = 8,
                 quantized_attention: bool = True):
        super().__init__(max_size, left_padding)
        self._quant(group_size, bits, quantized_attention)


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
        return self.c.update_and_fetch(keys, values)

    def make_mask(self, N, return_array: bool = False, window_size=None, **kwargs):
        # mlx-lm's single-row rule (KVCache.make_mask): arrays only when asked for
        return create_attention_mask(N, self.c._idx, return_array, window_size)

    def __getattr__(self, name):
        return getattr(self.c, name)
