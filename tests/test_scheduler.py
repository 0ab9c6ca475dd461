"""Scheduler: strict FIFO admission under max_batch and a KV budget checked against
the projected peak of a left-padded batch."""

from types import SimpleNamespace

from hypothesis import given, settings, strategies as st

from mlxnb.core.scheduler import Scheduler


def row(rid, prompt, max_tokens, generated=0):
    return SimpleNamespace(id=rid, prompt_tokens=prompt, tokens=[0] * generated,
                           params=SimpleNamespace(max_tokens=max_tokens))


def per_token(n, prefilling=True):
    return 10 * n


def reference_peak(rows, bytes_for):
    """Step the batch one token at a time: it is left-padded, so every row still in it
    occupies the batch's width, which starts at the longest row and grows by one per
    step; a row leaves after writing its last token. A row without tokens yet is
    charged as prefilling for as long as it stays."""
    if not rows:
        return 0
    width = max(r.prompt_tokens + len(r.tokens) for r in rows)
    left = [(max(0, r.params.max_tokens - len(r.tokens)), not r.tokens) for r in rows]

    def held():
        return sum(bytes_for(width, pre) for _, pre in left)

    peak = held()
    while any(n > 0 for n, _ in left):
        width += 1
        left = [(n - 1, pre) for n, pre in left if n > 0]
        peak = max(peak, held())
    return peak


def ids(rows):
    return [r.id for r in rows]


# -- projected peak -----------------------------------------------------------------

rows_st = st.lists(
    st.tuples(st.integers(1, 300), st.integers(1, 300), st.integers(0, 320)),
    min_size=1, max_size=8)
bytes_for_st = st.one_of(
    st.tuples(st.integers(1, 1000), st.integers(0, 5000), st.integers(0, 3000)).map(
        lambda abc: (lambda n, pre=True: abc[0] * n + abc[1] + abc[2] * pre)),
    # caches grow in whole blocks: a step function of the length
    st.integers(1, 300).map(lambda blk: (lambda n, pre=True: 4096 * -(-n // blk))),
    # a sliding window: capped at the window, plus a prefill chunk while prefilling
    st.tuples(st.integers(1, 400), st.integers(1, 600)).map(
        lambda wc: (lambda n, pre=True: 8 * min(n + 512, wc[0] + (wc[1] if pre else 64)))),
)


@settings(max_examples=300, deadline=None)
@given(rows_st, bytes_for_st)
def test_projected_peak_matches_step_by_step_simulation(specs, bytes_for):
    rows = [row(i, p, m, min(g, m + 5)) for i, (p, m, g) in enumerate(specs)]
    s = Scheduler(8, None, bytes_for)
    assert s.projected_peak(rows) == reference_peak(rows, bytes_for)


def test_projected_peak_edges():
    s = Scheduler(4, None, per_token)
    assert s.projected_peak([]) == 0
    # one row: its own final length
    assert s.projected_peak([row(1, 10, 5)]) == per_token(15)
    # a long row that finishes now still sets the width the short, long-lived row
    # starts from; at the short row's end only it is alive
    rows = [row(1, 100, 1), row(2, 10, 50)]
    assert s.projected_peak(rows) == max(2 * per_token(101), per_token(150))
    # a row past its max_tokens has nothing left: it only counts at the current width
    assert s.projected_peak([row(1, 10, 3, generated=5)]) == per_token(15)


# -- admission ----------------------------------------------------------------------

def test_fifo_stops_at_first_misfit_even_if_a_later_row_fits():
    s = Scheduler(8, per_token(200), per_token)
    s.enqueue(row(1, 50, 50))
    assert ids(s.admit()) == [1]
    big, small = row(2, 150, 100), row(3, 1, 1)
    s.enqueue(big)
    s.enqueue(small)
    # `small` alone would fit beside row 1, but it must not overtake `big`
    assert s.projected_peak([row(1, 50, 50), small]) <= s.kv_budget
    assert s.admit() == []
    assert list(s.queue) == [big, small]
    s.release(1)
    assert ids(s.admit()) == [2]
    assert list(s.queue) == [small]


def test_max_batch_caps_rows_in_flight():
    s = Scheduler(3, None, per_token)
    for i in range(5):
        s.enqueue(row(i, 10, 10))
    assert ids(s.admit()) == [0, 1, 2]
    assert s.admit() == []
    s.release(1)
    assert ids(s.admit()) == [3]
    assert sorted(s.active) == [0, 2, 3]
    assert ids(s.queue) == [4]


def test_no_budget_means_no_byte_limit():
    s = Scheduler(4, None, per_token)
    for i in range(6):
        s.enqueue(row(i, 10 ** 6, 10 ** 6))
    assert ids(s.admit()) == [0, 1, 2, 3]
    assert s.never_fits(10 ** 9, 10 ** 9) is None


def test_first_row_into_an_empty_batch_is_admitted_even_over_budget():
    s = Scheduler(4, 100, per_token)
    huge, next_ = row(1, 1000, 1000), row(2, 1, 1)
    s.enqueue(huge)
    s.enqueue(next_)
    # the row alone exceeds the budget; with nothing running it still starts
    # (never_fits is what turns such rows away before they are queued) ...
    assert ids(s.admit()) == [1]
    # ... but nothing joins it while its peak is over the budget
    assert s.admit() == []
    s.release(1)
    assert ids(s.admit()) == [2]


def test_budget_is_checked_against_the_peak_not_the_current_size():
    # now: 2 rows at length 20 = 400 bytes, well under 1000; but both grow to 60
    s = Scheduler(8, 1000, per_token)
    s.enqueue(row(1, 20, 40))
    assert ids(s.admit()) == [1]
    s.enqueue(row(2, 20, 40))
    assert s.admit() == []
    s.release(1)
    assert ids(s.admit()) == [2]


def test_peak_equal_to_budget_is_admitted():
    s = Scheduler(8, 2 * per_token(20), per_token)
    s.enqueue(row(1, 10, 10))
    s.enqueue(row(2, 10, 10))
    assert ids(s.admit()) == [1, 2]
    s2 = Scheduler(8, 2 * per_token(20) - 1, per_token)
    s2.enqueue(row(1, 10, 10))
    s2.enqueue(row(2, 10, 10))
    assert ids(s2.admit()) == [1]


def test_running_rows_progress_is_read_off_the_rows():
    s = Scheduler(8, 2500, per_token)
    r1 = row(1, 10, 100)
    s.enqueue(r1)
    assert ids(s.admit()) == [1]
    # the newcomer sets the width (100); r1 would still have 100 tokens to go from
    # there: 2 rows at 150 = 3000
    s.enqueue(row(2, 100, 50))
    assert s.admit() == []
    # 90 tokens later r1 has 10 to go: 2 rows at 110 = 2200
    r1.tokens = [0] * 90
    assert ids(s.admit()) == [2]


@settings(max_examples=200, deadline=None)
@given(
    running=st.lists(st.tuples(st.integers(1, 200), st.integers(1, 200),
                               st.integers(0, 200)), max_size=4),
    queued=st.lists(st.tuples(st.integers(1, 200), st.integers(1, 200)),
                    max_size=6),
    max_batch=st.integers(1, 8),
    budget=st.integers(1, 20000),
)
def test_admission_invariants(running, queued, max_batch, budget):
    s = Scheduler(max_batch, budget, per_token)
    live = []
    for i, (p, m, g) in enumerate(running):
        s.enqueue(row(i, p, m, min(g, m)))
        live += s.admit()
    for j, (p, m) in enumerate(queued):
        s.enqueue(row(100 + j, p, m))
    queue = list(s.queue)
    got = s.admit()
    alive = live + got
    # FIFO: a prefix of the queue is admitted, the rest stays queued in order
    assert got == queue[:len(got)]
    assert list(s.queue) == queue[len(got):]
    assert len(s.active) <= max_batch
    assert sorted(s.active) == sorted(r.id for r in alive)
    # whatever now runs together fits, unless it is one row started alone
    if got and len(alive) > 1:
        assert reference_peak(alive, per_token) <= budget
    # the head of the queue waits only for a reason
    if s.queue and len(s.active) < max_batch:
        assert s.active
        assert reference_peak(alive + [s.queue[0]], per_token) > budget


# -- never_fits ---------------------------------------------------------------------

def test_never_fits_boundary_and_message():
    s = Scheduler(4, per_token(100), per_token)
    assert s.row_bytes(60, 40) == per_token(100)
    assert s.never_fits(60, 40) is None
    msg = s.never_fits(60, 41)
    assert msg is not None
    assert "\n" not in msg
    assert "kv_budget" in msg
    assert "60" in msg and "41" in msg


def test_never_fits_without_budget_is_none():
    assert Scheduler(4, None, per_token).never_fits(10 ** 9, 10 ** 9) is None


# -- bookkeeping --------------------------------------------------------------------

def test_release_frees_a_slot_and_ignores_unknown_ids():
    s = Scheduler(1, None, per_token)
    s.enqueue(row(1, 5, 5))
    s.enqueue(row(2, 5, 5))
    assert ids(s.admit()) == [1]
    s.release(99)
    s.release(2)  # queued, not running: it must stay queued
    assert s.admit() == []
    assert ids(s.queue) == [2]
    s.release(1)
    s.release(1)
    assert ids(s.admit()) == [2]


def test_dequeue_removes_a_queued_row_only():
    s = Scheduler(1, None, per_token)
    a, b, c = row(1, 5, 5), row(2, 5, 5), row(3, 5, 5)
    for r in (a, b, c):
        s.enqueue(r)
    assert ids(s.admit()) == [1]
    assert s.dequeue(b) is True
    assert s.dequeue(b) is False  # already gone
    assert s.dequeue(a) is False  # running, not queued
    assert s.dequeue(row(9, 5, 5)) is False  # never seen
    s.release(1)
    assert ids(s.admit()) == [3]


def test_clear_forgets_queue_and_running_rows():
    s = Scheduler(2, per_token(30), per_token)
    for i in range(4):
        s.enqueue(row(i, 10, 10))
    assert ids(s.admit()) == [0]
    s.clear()
    assert not s.queue and not s.active
    assert s.admit() == []
    s.enqueue(row(7, 10, 10))
    assert ids(s.admit()) == [7]
