"""Prompt-prefix KV reuse: rows that share a prefix (system prompt, few-shot header,
`--n` samples of one prompt) copy its KV instead of prefilling it again.

Entries are whole prefilled prompts, copied out of the prefill's KV arrays (a row of
a batch, from `start` for `n` tokens; quantized KV as its mx.quantize triplets,
whose groups run along the head dimension, so a slice of positions is exact). A
lookup takes the longest common prefix with any entry and hands out slices of it
(new arrays: the row's in-place cache updates never reach the entry).
Only models whose layers are all full-attention KV take part: rotating windows
would need the evicted tokens back, and a recurrent state holds no per-position
history to cut at a prefix.
Entries are keyed by the adapter the prompt ran under as well (`ns`): KV computed
with one LoRA adapter (or none) is never handed to a row that uses another.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import List, NamedTuple, Optional

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache

from .caches import BatchQuantizedKVCache

_KINDS = (KVCache, BatchQuantizedKVCache)


def _slice(x, sl):
    """x[sl] for an array, or for each array of a quantized triplet."""
    return tuple(t[sl] for t in x) if isinstance(x, tuple) else x[sl]


def _common_prefix(a: tuple, b: List[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixHit(NamedTuple):
    tokens: int  # prompt tokens the cache already holds
    cache: Optional[list]  # a fresh single-row cache, None when tokens == 0


class PrefixStore:
    """`make_cache()` gives a fresh single-row cache of the engine's kinds, which a
    lookup fills with the prefix."""

    def __init__(self, max_bytes: int, make_cache, max_entries: int = 64,
                 min_tokens: int = 8):
        self.max_bytes = max_bytes
        self.make_cache = make_cache
        self.max_entries = max_entries
        self.min_tokens = min_tokens
        # (adapter, key tokens) -> (per-layer [(keys, values)] sliced to [1, H, n, *], bytes)
        self._entries: "OrderedDict[tuple, tuple]" = OrderedDict()
        self.nbytes = 0

    @staticmethod
    def supports(cache: list) -> bool:
        return all(type(c) in _KINDS for c in cache)

    def lookup(self, ids: List[int], ns=None) -> "PrefixHit":
        """A fresh single-row cache holding the first n tokens of `ids` (n = 0: none),
        from entries made under the same adapter `ns` (None: none)."""
        best, best_key = 0, None
        for key in self._entries:
            if key[0] != ns:
                continue
            n = _common_prefix(key[1], ids)
            if n > best:
                best, best_key = n, key
        best = min(best, len(ids) - 1)
        if best < self.min_tokens or best_key is None:
            return PrefixHit(0, None)
        self._entries.move_to_end(best_key)
        cache = self.make_cache()
        upto = (Ellipsis, slice(None, best), slice(None))
        for c, (keys, values) in zip(cache, self._entries[best_key][0]):
            if type(c) is KVCache:
                c.keys, c.values, c.offset = _slice(keys, upto), _slice(values, upto), best
            else:
                c.load(_slice(keys, upto), _slice(values, upto))
        return PrefixHit(best, cache)

    def add(self, ids: List[int], layers: list, row: int, start: int, ns=None) -> None:
        """Remember `ids` as held by `layers` ([(keys, values)] of a batch) at `row`,
        positions start .. start + len(ids), computed under adapter `ns`."""
        n = len(ids)
        if self.max_bytes <= 0 or n < self.min_tokens:
            return
        key = (ns, tuple(ids))
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        # A copy: a view would keep the whole prefill group's buffer (every row, all
        # padding) alive, several times what the entry accounts for.
        sl = (slice(row, row + 1), slice(None), slice(start, start + n), slice(None))

        def copy(x):
            x = _slice(x, sl)
            return tuple(map(mx.contiguous, x)) if isinstance(x, tuple) else mx.contiguous(x)

        sliced = [(copy(k), copy(v)) for k, v in layers]
        mx.eval(sliced)
        size = sum(a.nbytes for _, a in tree_flatten(sliced))
        if size > self.max_bytes:
            return
        self._entries[key] = (sliced, size)
        self.nbytes += size
        while self.nbytes > self.max_bytes or len(self._entries) > self.max_entries:
            _, (_, old) = self._entries.popitem(last=False)
            self.nbytes -= old

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0

    def forget(self, ns) -> None:
        """Drop the entries computed under adapter `ns` (unloaded: a later adapter of
        the same name computes other KV)."""
        for key in [k for k in self._entries if k[0] == ns]:
            self.nbytes -= self._entries.pop(key)[1]
