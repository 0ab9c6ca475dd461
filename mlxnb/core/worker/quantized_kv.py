"""Quantized KV caches in batch form: mx.quantize triplets laid out like mlx-lm's
BatchKVCache and BatchRotatingKVCache (caches.py maps each cache kind to these)."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import BatchRotatingKVCache, RotatingKVCache

from .kv_attention import FusedKV
from .roll import finalize_padding
from .windows import PrefillOneWide


def round_up(n: int, step: int) -> int:
    return -(-n // step) * step


# -- one row's cache ------------------------------------------------------------------

ATTENTION_MODES = ("quantized", "fused", "dequantized")


class _Quantized:
    """Quantization settings of a KV cache and how attention reads it (`attention`):

      quantized    the cache has `bits` and `group_size`, so mlx-lm's attention
                   multiplies the mx.quantize triplets directly (Metal, CPU)
      fused        one query token (decode): the triplets go to kv_attention's fused
                   kernel as a FusedKV; longer chunks read them dequantized (CUDA)
      dequantized  attention gets them dequantized (plain attention)

    The memory held is the same in every mode; the engine picks at load (setup.py)."""

    _fused_now = False  # the last update was one token in "fused" mode

    def _quant(self, group_size: int, bits: int, attention="quantized"):
        if attention is True or attention is False:
            attention = "quantized" if attention else "dequantized"
        if attention not in ATTENTION_MODES:
            raise ValueError(f"attention must be one of {ATTENTION_MODES}, not {attention!r}")
        self.q_group, self.q_bits, self.attention = group_size, bits, attention

    @property
    def quantized_attention(self) -> bool:
        return self.attention != "dequantized"

    def __getattr__(self, name):  # only for names not set on the instance
        d = self.__dict__
        if name in ("bits", "group_size") and (
                d.get("attention") == "quantized" or d.get("_fused_now")):
            return d["q_bits"] if name == "bits" else d["q_group"]
        raise AttributeError(name)

    def _for_attention(self, trip, n: int = 0):
        """What attention reads of a triplet, after an update of `n` tokens."""
        mode = self.attention
        if mode == "quantized":
            return trip
        if mode == "fused" and n == 1:
            return FusedKV(trip)
        return mx.dequantize(*trip, group_size=self.q_group, bits=self.q_bits)


class BatchQuantizedKVCache(_Quantized):
    """A left-padded batch of quantized keys and values: `keys` and `values` are
    mx.quantize triplets (packed uint32, scales, biases), each [B, H, S, *]. mlx-lm
    has a single-row QuantizedKVCache only; this is its batch form (and, with one
    row, the engine's single-row form), laid out like BatchKVCache (same padding,
    filter, extend and finalize rules)."""

    step = 256

    def __init__(self, left_padding: list, group_size: int = 64, bits: int = 8,
                 attention="quantized"):
        self.keys = self.values = None
        self.left_padding = mx.array(left_padding)
        self._idx = 0
        self._right_padding = None
        self._quant(group_size, bits, attention)

    @property
    def offset(self):
        return self._idx - self.left_padding

    def update_and_fetch(self, keys, values):
        B, H, n, _ = keys.shape
        prev = self._idx
        if self.keys is None or prev + n > self.keys[0].shape[2]:
            new = round_up(n, self.step)

            def grow(old, x):
                D = x.shape[-1]  # packed: D * bits / 32 words (bits need not divide 32)
                fresh = (mx.zeros((B, H, new, D * self.q_bits // 32), mx.uint32),
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
        # mlx-lm asks the cache for `bits` right after this: only a fused decode has it
        self._fused_now = self.attention == "fused" and n == 1
        i = self._idx
        return (self._for_attention(tuple(x[..., :i, :] for x in self.keys), n),
                self._for_attention(tuple(x[..., :i, :] for x in self.values), n))

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        if left_padding is not None:
            if self.keys is not None:
                raise ValueError("left padding can only be added to an empty cache")
            self.left_padding = self.left_padding + mx.array(left_padding)
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = mx.array(right_padding)

    finalize = finalize_padding  # right padding (a prefill group's) to left (roll.py)

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
        # (a window's packed words are not laid out for the fused kernel: any
        # mode but "quantized" reads them dequantized)
        return self._for_attention((p[..., :n], sb[..., :half], sb[..., half:]))

    def update_and_fetch(self, keys, values):
        k, v = super().update_and_fetch(self._pack(keys), self._pack(values))
        return self._unpack(k, keys), self._unpack(v, values)


class QuantizedRotatingKVCache(_Packed, RotatingKVCache):
    """mlx-lm's RotatingKVCache (a sliding window) holding quantized keys/values,
    which mlx-lm does not offer; one row, as `make_row_cache` builds it."""

    def __init__(self, max_size, group_size: int = 64, bits: int = 8,
                 attention="quantized"):
        super().__init__(max_size)
        self._quant(group_size, bits, attention)


class BatchQuantizedRotatingKVCache(_Packed, PrefillOneWide, BatchRotatingKVCache):
    """mlx-lm's BatchRotatingKVCache holding quantized keys/values."""

    def __init__(self, max_size, left_padding: list, group_size: int = 64, bits: int = 8,
                 attention="quantized"):
        super().__init__(max_size, left_padding)
        self._quant(group_size, bits, attention)
