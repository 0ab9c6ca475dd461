"""Prompt-prefix KV reuse: rows that share a prefix (system prompt, few-shot header,
`--n` samples of one prompt) copy its KV instead of prefilling it again.

Entries are whole prefilled prompts, copied out of the prefill's KV arrays (a row of
a batch, from `start` for `n` tokens). A lookup takes the longest common prefix with
any entry and hands out slices of it (new arrays: the row's in-place cache updates
never reach the entry).
Only models whose caches are all plain, trimmable `KVCache`s take part (rotating
windows would need the evicted tokens back).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import List, Optional, Tuple

import mlx.core as mx
from mlx_lm.models.cache import KVCache


def _common_prefix(a: tuple, b: List[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixStore:
    def __init__(self, max_bytes: int, max_entries: int = 64, min_tokens: int = 8):
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.min_tokens = min_tokens
        # key tokens -> (per-layer [(keys, values)] sliced to [1, H, n, D], bytes)
        self._entries: "OrderedDict[tuple, tuple]" = OrderedDict()
        self.nbytes = 0

    @staticmethod
    def supports(cache: list) -> bool:
        return all(type(c) is KVCache for c in cache)

    def lookup(self, ids: List[int]) -> Tuple[int, Optional[list]]:
        """(n, cache): a fresh single-row cache holding the first n tokens of `ids`."""
        best, best_key = 0, None
        for key in self._entries:
            n = _common_prefix(key, ids)
            if n > best:
                best, best_key = n, key
        best = min(best, len(ids) - 1)
        if best < self.min_tokens or best_key is None:
            return 0, None
        self._entries.move_to_end(best_key)
        cache = []
        for keys, values in self._entries[best_key][0]:
            c = KVCache()
            c.keys, c.values = keys[..., :best, :], values[..., :best, :]
            c.offset = best
            cache.append(c)
        return best, cache

    def add(self, ids: List[int], layers: list, row: int, start: int) -> None:
        """Remember `ids` as held by `layers` ([(keys, values)] of a batch) at `row`,
        positions start .. start + len(ids)."""
        n = len(ids)
        if self.max_bytes <= 0 or n < self.min_tokens:
            return
        key = tuple(ids)
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        # A copy: a view would keep the whole prefill group's buffer (every row, all
        # padding) alive, several times what the entry accounts for.
        sliced = [(mx.contiguous(k[row:row + 1, :, start:start + n, :]),
                   mx.contiguous(v[row:row + 1, :, start:start + n, :])) for k, v in layers]
        mx.eval(sliced)
        size = sum(k.nbytes + v.nbytes for k, v in sliced)
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
