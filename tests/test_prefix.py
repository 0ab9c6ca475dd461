"""PrefixStore: prompt-prefix KV reuse. A hit hands out a single-row cache that a
model continues exactly as if it had prefilled the whole prompt."""

import random

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

from mlxnb.core.worker.caches import make_row_cache
from mlxnb.core.worker.prefix import PrefixStore


@pytest.fixture(scope="module")
def q_model():
    """Head dim 32, so KV can quantize in groups of 32."""
    from mlxnb.models.tiny import tiny_model

    return tiny_model(hidden=128)[0]


def prompt(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def prefilled(model, ids, **kv):
    """(layers as a prefill leaves them, the last position's logits)."""
    cache = make_row_cache(model, **kv)
    logits = model(mx.array([ids]), cache=cache)[0, -1]
    mx.eval(logits)
    return [(c.keys, c.values) for c in cache], logits


def next_logits(model, ids, **kv):
    return prefilled(model, ids, **kv)[1]


def continued(model, cache, rest):
    out = model(mx.array([rest]), cache=cache)[0, -1]
    mx.eval(out)
    return out


def store_for(model, max_bytes=1 << 30, **kw):
    kv = kw.pop("kv", {})
    return PrefixStore(max_bytes, lambda: make_row_cache(model, **kv), **kw), kv


def remember(store, model, ids, kv=None):
    layers, _ = prefilled(model, ids, **(kv or {}))
    store.add(ids, layers, 0, 0)


def close(a, b):
    return mx.allclose(a, b, atol=1e-4, rtol=1e-4).item()


def test_unseen_prompt_misses(tiny):
    model = tiny[0]
    store, _ = store_for(model)
    assert store.lookup(prompt(20, 0)) == (0, None)
    remember(store, model, prompt(20, 1))
    # shares no first token with the entry
    other = prompt(20, 2)
    assert other[0] != prompt(20, 1)[0]
    assert store.lookup(other) == (0, None)


@pytest.mark.parametrize("kv", [{}, dict(kv_bits=8, kv_group_size=32),
                                dict(kv_bits=4, kv_group_size=32)],
                         ids=["plain", "q8", "q4"])
def test_hit_continues_like_a_full_prefill(tiny, q_model, kv):
    model = tiny[0] if not kv else q_model
    store, _ = store_for(model, kv=kv)
    head = prompt(24, 3)
    remember(store, model, head, kv)
    ids = head + prompt(7, 4)
    n, cache = store.lookup(ids)
    assert n == len(head)
    assert close(continued(model, cache, ids[n:]), next_logits(model, ids, **kv))


def test_hit_length_is_the_common_prefix(tiny):
    model = tiny[0]
    store, _ = store_for(model)
    entry = prompt(30, 5)
    remember(store, model, entry)
    # diverges from the entry at position 17
    ids = entry[:17] + [(entry[17] + 1) % 256] + prompt(5, 6)
    n, cache = store.lookup(ids)
    assert n == 17
    assert close(continued(model, cache, ids[n:]), next_logits(model, ids))


def test_hit_leaves_at_least_one_token_to_prefill(tiny):
    model = tiny[0]
    store, _ = store_for(model)
    entry = prompt(30, 7)
    remember(store, model, entry)
    # the very same prompt: its last token must still run to give logits
    n, cache = store.lookup(entry)
    assert n == len(entry) - 1
    assert close(continued(model, cache, entry[n:]), next_logits(model, entry))
    # a prompt the entry extends
    short = entry[:12]
    n, cache = store.lookup(short)
    assert n == 11
    assert close(continued(model, cache, short[n:]), next_logits(model, short))


def test_min_tokens(tiny):
    model = tiny[0]
    store, _ = store_for(model, min_tokens=8)
    remember(store, model, prompt(7, 8))  # too short to keep
    assert store.nbytes == 0
    entry = prompt(20, 9)
    remember(store, model, entry)
    assert store.lookup(entry[:7] + prompt(5, 10))[0] == 0
    assert store.lookup(entry[:8] + [(entry[8] + 1) % 256])[0] == 8
    # 8 tokens in common but only 7 of them reusable: a miss
    assert store.lookup(entry[:8]) == (0, None)
    assert store.lookup(entry[:9])[0] == 8


def test_longest_common_prefix_wins(tiny):
    model = tiny[0]
    store, _ = store_for(model)
    base = prompt(40, 11)
    a = base[:12] + prompt(10, 12)
    b = base[:25] + prompt(10, 13)
    for e in (b, a):
        remember(store, model, e)
    n, cache = store.lookup(base)
    assert n == 25
    assert close(continued(model, cache, base[n:]), next_logits(model, base))


def test_row_and_left_offset_of_a_batch(tiny):
    """`add` takes one row of a left-padded batch: the row's KV starts at `start`."""
    model = tiny[0]
    store, _ = store_for(model)
    ids = prompt(16, 14)
    layers, _ = prefilled(model, ids)
    pad, rows, row = 5, 3, 1
    batch = []
    for k, v in layers:
        def embed(x):
            x = x[..., :len(ids), :]
            noise = mx.random.normal((rows, x.shape[1], pad + len(ids) + 3, x.shape[3]),
                                     key=mx.random.key(0))
            noise[row:row + 1, :, pad:pad + len(ids), :] = x
            return noise
        batch.append((embed(k), embed(v)))
    store.add(ids, batch, row, pad)
    full = ids + prompt(4, 15)
    n, cache = store.lookup(full)
    assert n == len(ids)
    assert close(continued(model, cache, full[n:]), next_logits(model, full))


def test_entries_are_not_changed_by_the_rows_that_reuse_them(tiny):
    model = tiny[0]
    store, _ = store_for(model)
    head = prompt(20, 16)
    remember(store, model, head)
    for seed in (17, 18, 19):
        ids = head + prompt(6, seed)
        n, cache = store.lookup(ids)
        assert n == len(head)
        # the row decodes on from its cache, several steps
        for t in ids[n:]:
            continued(model, cache, [t])
        for c in cache:
            c.keys[..., :n, :] = 0
        mx.eval([c.keys for c in cache])
    ids = head + prompt(6, 20)
    n, cache = store.lookup(ids)
    assert close(continued(model, cache, ids[n:]), next_logits(model, ids))


# -- bytes and eviction ---------------------------------------------------------------

def entry_bytes(model, n):
    store, _ = store_for(model)
    remember(store, model, prompt(n, 99))
    return store.nbytes


def test_nbytes_never_exceeds_max_bytes(tiny):
    model = tiny[0]
    unit = entry_bytes(model, 10)
    assert unit > 0
    max_bytes = int(3.5 * unit)
    store, _ = store_for(model, max_bytes=max_bytes)
    rng = random.Random(0)
    for i in range(25):
        remember(store, model, prompt(rng.randrange(8, 30), 1000 + i))
        assert 0 <= store.nbytes <= max_bytes
    assert store.nbytes > 0


def test_evicts_least_recently_used(tiny):
    model = tiny[0]
    unit = entry_bytes(model, 10)
    store, _ = store_for(model, max_bytes=2 * unit)
    a, b, c = (prompt(10, s) for s in (21, 22, 23))
    assert len({a[0], b[0], c[0]}) == 3
    remember(store, model, a)
    remember(store, model, b)
    assert store.nbytes == 2 * unit
    # a lookup hit makes `a` the most recently used: `b` goes first
    assert store.lookup(a + [1])[0] == 10
    remember(store, model, c)
    assert store.nbytes == 2 * unit
    assert store.lookup(b + [1]) == (0, None)
    assert store.lookup(a + [1])[0] == 10
    assert store.lookup(c + [1])[0] == 10
    # adding a held prompt again refreshes it without counting it twice
    remember(store, model, c)
    assert store.nbytes == 2 * unit
    remember(store, model, b)
    assert store.lookup(a + [1]) == (0, None)
    assert store.lookup(c + [1])[0] == 10


def test_max_entries(tiny):
    model = tiny[0]
    store, _ = store_for(model, max_entries=2)
    a, b, c = (prompt(10, s) for s in (31, 32, 33))
    for e in (a, b, c):
        remember(store, model, e)
    assert store.lookup(a + [1]) == (0, None)
    assert store.lookup(b + [1])[0] == 10
    assert store.lookup(c + [1])[0] == 10


def test_an_entry_over_the_whole_budget_is_not_kept(tiny):
    model = tiny[0]
    unit = entry_bytes(model, 10)
    store, _ = store_for(model, max_bytes=2 * unit)
    small = prompt(10, 41)
    remember(store, model, small)
    remember(store, model, prompt(40, 42))  # 4 units: more than the whole store
    assert store.nbytes == unit
    assert store.lookup(small + [1])[0] == 10


def test_zero_budget_keeps_nothing(tiny):
    model = tiny[0]
    store, _ = store_for(model, max_bytes=0)
    entry = prompt(20, 43)
    remember(store, model, entry)
    assert store.nbytes == 0
    assert store.lookup(entry + [1]) == (0, None)


def test_clear(tiny):
    model = tiny[0]
    store, _ = store_for(model)
    entry = prompt(20, 44)
    remember(store, model, entry)
    assert store.nbytes > 0
    store.clear()
    assert store.nbytes == 0
    assert store.lookup(entry + [1]) == (0, None)
    remember(store, model, entry)
    assert store.lookup(entry + [1])[0] == 20


# -- which models take part -----------------------------------------------------------

def test_supports_full_attention_kv_only(tiny, tiny_swa, q_model):
    assert PrefixStore.supports(make_row_cache(tiny[0]))
    assert PrefixStore.supports(make_row_cache(q_model, kv_bits=4, kv_group_size=32))
    assert not PrefixStore.supports(make_row_cache(tiny_swa[0]))
    assert not PrefixStore.supports([KVCache(), ArraysCache(2)])
    assert not PrefixStore.supports([KVCache(), RotatingKVCache(16)])
    assert not PrefixStore.supports([CacheList(KVCache(), KVCache())])


def test_status_shows_what_the_prefix_store_holds_beside_the_budget(tiny, arun):
    import mlxnb

    async def main():
        eng = mlxnb.Engine(tiny, kv_budget="4MB", prefix_cache="1MB", warmup=False)
        before = eng.status()
        await eng.submit("a shared prompt prefix, long enough to keep " * 4, chat=False,
                         max_tokens=2)
        after = eng.status()
        await eng.aclose()
        return before, after

    before, after = arun(main)
    assert "holding" not in before
    held = after.split("prefix reuse on (holding ", 1)[1].split(")", 1)[0]
    assert held.endswith(" of 1.0 MB") and not held.startswith("0 B"), after
