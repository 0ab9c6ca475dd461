"""Reliability under careless or hostile use: stalled loads, engine lifetime, threads,
atomic saves, special files, chat templates, long-lived kernels, odd widget messages,
extreme sampling values and huge prompts.

Everything runs on the tiny random-weight model; a stalled hub is a local socket
that accepts connections and never answers. Each test states the failure it guards.
"""

import _thread
import asyncio
import contextlib
import datetime
import gc
import json
import os
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time
import tracemalloc
import weakref
from pathlib import Path

import pytest

from mlxnb import Engine, Run
from mlxnb.models.loading import ModelLoadError
from mlxnb.models.tiny import save_tiny_model, tiny_model

REPO = Path(__file__).resolve().parents[1]


def make(model, **kw):
    kw.setdefault("kv_budget", None)
    return Engine(model, **kw)


def one_line(msg: str) -> bool:
    return bool(msg) and "\n" not in msg and "Traceback" not in msg


# ------------------------------------------------------------------ a stalled hub
@contextlib.contextmanager
def stalling_hub(monkeypatch, answer_root: bool):
    """A hub endpoint that accepts connections and never answers a request (with
    `answer_root`, it answers `HEAD /` at once, so only the download stalls). Yields
    an Event set once a request is left unanswered (a load is waiting on it)."""
    import huggingface_hub.constants as hf

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    srv.settimeout(0.05)
    held, stop, stalled = [], threading.Event(), threading.Event()

    def answer(c):
        try:
            c.settimeout(10)
            if c.recv(65536).startswith(b"HEAD / "):
                c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n"
                          b"Connection: close\r\n\r\n")
                c.close()
            else:
                stalled.set()
        except OSError:
            pass

    def serve():
        while not stop.is_set():
            try:
                c, _ = srv.accept()
            except OSError:
                continue
            held.append(c)
            if answer_root:
                threading.Thread(target=answer, args=(c,), daemon=True).start()
            else:
                stalled.set()

    threading.Thread(target=serve, daemon=True).start()
    url = f"http://127.0.0.1:{srv.getsockname()[1]}"
    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.setattr(hf, "ENDPOINT", url)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(hf, "HF_HUB_OFFLINE", False, raising=False)
    for k in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY",
              "all_proxy"):
        monkeypatch.delenv(k, raising=False)
    try:
        yield stalled
    finally:
        stop.set()
        for c in held:
            c.close()
        srv.close()


async def tokens_in(row, seconds: float) -> int:
    n = row.ntok
    await asyncio.sleep(seconds)
    return row.ntok - n


@pytest.mark.integration
@pytest.mark.parametrize("answer_root", [False, True], ids=["silent", "stalls-download"])
def test_a_stalled_hub_load_leaves_running_rows_at_their_rate(tiny, arun, monkeypatch,
                                                              answer_root):
    """A load that stalls on the network ends with a one-line ModelLoadError within its
    bound, and meanwhile a running engine decodes at its normal rate; after it, rows
    and new engines work (the load never held the MLX worker)."""
    with stalling_hub(monkeypatch, answer_root):
        async def main():
            eng = make(tiny)
            row = eng.submit("a long row", chat=False, max_tokens=4000)
            while row.ntok < 5:
                await asyncio.sleep(0.01)
            before = await tokens_in(row, 1.0)
            t = time.perf_counter()
            load = asyncio.create_task(asyncio.to_thread(
                Engine, "mlxnb-test/never-answers", loop=asyncio.get_running_loop(),
                load_timeout=3))
            during = await tokens_in(row, 2.0)
            with pytest.raises(ModelLoadError) as e:
                await asyncio.wait_for(load, 20)
            took = time.perf_counter() - t
            row.cancel()
            await row
            nxt = await asyncio.wait_for(eng.submit("next", chat=False, max_tokens=4), 10)
            other = await asyncio.wait_for(asyncio.to_thread(
                make, tiny, loop=asyncio.get_running_loop()), 20)
            again = await asyncio.wait_for(other.submit("x", chat=False, max_tokens=3), 10)
            await eng.aclose()
            await other.aclose()
            return before, during, took, str(e.value), nxt, again

        before, during, took, msg, nxt, again = arun(main)
    assert during >= 0.5 * before, f"decoded {during} tokens in 2 s of load vs {before}/s"
    assert took < 8, f"the stalled load took {took:.1f} s to fail"
    assert one_line(msg) and "never-answers" in msg
    assert nxt.finish_reason == "length" and again.finish_reason == "length"


def test_an_interrupt_ends_a_stalled_load_and_frees_everything(tiny, monkeypatch):
    """KeyboardInterrupt (the notebook's stop button) ends a load that has no time
    limit at once, and the next engine starts at once."""
    import signal
    # Python's own SIGINT handler, whatever ran before in this process (interrupt_main
    # does nothing where SIGINT is ignored or left to the system's default)
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    with stalling_hub(monkeypatch, answer_root=True) as stalled:
        loop = asyncio.new_event_loop()

        fired = []

        def interrupt():  # once the load waits on the hub: the load is what it ends
            stalled.wait(30)
            time.sleep(0.2)
            fired.append(time.perf_counter())
            _thread.interrupt_main()
        threading.Thread(target=interrupt, daemon=True).start()
        try:
            with pytest.raises(KeyboardInterrupt):
                Engine("mlxnb-test/never-answers", loop=loop, load_timeout=None)
        finally:
            signal.signal(signal.SIGINT, old)
        took = time.perf_counter() - fired[0]
        assert stalled.is_set(), "the load never reached the hub"
        box = []
        th = threading.Thread(target=lambda: box.append(make(tiny, loop=loop)), daemon=True)
        th.start()
        th.join(5)
        assert box, "a new Engine could not start after the interrupted load"
        res = loop.run_until_complete(
            asyncio.wait_for(box[0].submit("x", chat=False, max_tokens=3), 10))
        box[0].close()
        loop.close()
    assert took < 1 and res.finish_reason == "length"


# ------------------------------------------------------------ lifetime and memory
@pytest.mark.integration
def test_closed_engines_release_their_models(arun):
    """Closing an engine releases its model even while its runs and widgets are kept;
    dropping the engine then frees it whole (widgets hold what they show)."""
    import mlx.core as mx

    from mlxnb.notebook.widget import GenerationWidget

    kept, refs = [], []

    async def cycle(seed):
        model = tiny_model(seed=seed, hidden=256, layers=4)
        eng = make(model)
        refs.append((weakref.ref(eng), weakref.ref(model[0])))
        del model
        run = eng.generate(["hello there", "and you"], chat=False, max_tokens=8)
        run.widget = GenerationWidget(eng, run.rows)
        texts = [r.text for r in await run]
        await eng.aclose()
        assert eng.model is None and eng.tokenizer is None
        kept.append(run)
        return texts

    async def main():
        await cycle(99)  # one-off allocations of a first engine (compiled kernels)
        kept.clear()
        refs.clear()
        gc.collect()
        mx.synchronize()
        mem0 = mx.get_active_memory()
        texts = [await cycle(i) for i in range(3)]
        gc.collect()
        mx.synchronize()
        return texts, mx.get_active_memory() - mem0

    texts, held = arun(main)
    alive = [(e() is not None, m() is not None) for e, m in refs]
    assert alive == [(False, False)] * 3, f"(engine, model) still alive: {alive}"
    assert held < 1 << 20, f"{held} bytes of device memory still held"
    for run, t in zip(kept, texts):  # what the user kept still reads
        assert run.texts == t and run.done and "2 rows" in repr(run)
        assert "done" in run.widget.summary_text()


def test_finished_rows_are_not_kept_by_the_engine(tiny, arun):
    """A long-lived engine holds its unfinished rows only: finished rows live as long
    as the user's handles (a Run, a variable)."""

    async def main():
        eng = make(tiny, max_batch=64)
        tracemalloc.start()

        async def rows_then_snapshot(n):
            for _ in range(n):
                await eng.generate([f"row {i}" for i in range(100)], chat=False,
                                   max_tokens=2)
            eng.steps.clear()  # the step history is bounded on its own (_KEEP_STEPS)
            gc.collect()
            return tracemalloc.take_snapshot()

        base = await rows_then_snapshot(5)  # both snapshots hold the latest run's results
        grown = (await rows_then_snapshot(10)).compare_to(base, "filename")
        tracemalloc.stop()
        kept = eng.generate(["kept"], chat=False, max_tokens=2)
        await kept
        out = (sum(s.size_diff for s in grown if "mlxnb" in s.traceback[0].filename),
               len(eng.rows), eng.submitted, dict(eng.finished), kept.rows[0] in eng.rows)
        await eng.aclose()
        return out

    grown, nrows, submitted, finished, kept_listed = arun(main)
    assert nrows == 1 and kept_listed  # only the row still held
    assert submitted == 1501 and finished == {"length": 1501}
    assert grown < 20_000, f"{grown} bytes kept by mlxnb for 1,000 dropped rows"


# ------------------------------------------------------------------ threads
def test_reading_text_from_other_threads_never_corrupts_it(arun):
    """Row.text read from another thread (an ipykernel subshell) while the loop also
    reads it (the widget): every row still ends with exactly its own text."""
    model = tiny_model(seed=3)
    prompts = [f"prompt {i} " * 3 for i in range(12)]

    async def go(reader: bool):
        eng = make(model)
        run = eng.generate(prompts, chat=False, max_tokens=300)
        stop = threading.Event()

        def hammer():
            while not stop.is_set():
                for r in run.rows:
                    _ = r.text

        eng.add_listener(lambda kind, obj: [r.text for r in run.rows])
        threads = [threading.Thread(target=hammer) for _ in range(2 if reader else 0)]
        for th in threads:
            th.start()
        res = await run
        stop.set()
        for th in threads:
            th.join()
        await eng.aclose()
        return [r.text for r in res], [r.tokens for r in res]

    ref_texts, ref_tokens = arun(go, False)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often: a race shows up at once
    try:
        texts, tokens = arun(go, True)
    finally:
        sys.setswitchinterval(interval)
    assert tokens == ref_tokens
    bad = [i for i, (a, b) in enumerate(zip(texts, ref_texts)) if a != b]
    assert not bad, f"rows {bad} came out corrupted"


def test_an_engine_needs_a_loop_it_can_reach(tiny, arun):
    """Built in a plain thread (no loop there, no kernel) an Engine binds no loop
    (asyncio would give it a fresh one nobody runs: `await row` hung): a submit there
    is refused at once, and async code that submits later is served on its own loop.
    Rows of an engine whose loop does not run are refused, not left to hang."""
    box = []

    def build(**kw):
        try:
            eng = box[0] if box else make(tiny, **kw)
            box.append(eng)
            eng.submit("hi", chat=False, max_tokens=2)
        except Exception as e:
            box.append(e)

    th = threading.Thread(target=build)
    th.start()
    th.join(30)
    eng, err = box
    assert isinstance(err, RuntimeError) and one_line(str(err))
    assert "event loop" in str(err) and "loop=" in str(err)

    async def main():
        res = await asyncio.wait_for(eng.submit("hi", chat=False, max_tokens=4), 10)
        await eng.aclose()
        return res

    assert arun(main).finish_reason == "length"

    async def built_in_a_thread_for_this_loop():
        eng = await asyncio.to_thread(make, tiny, loop=asyncio.get_running_loop())
        res = await asyncio.wait_for(eng.submit("hi", chat=False, max_tokens=4), 10)
        await eng.aclose()
        return res

    assert arun(built_in_a_thread_for_this_loop).finish_reason == "length"

    idle = asyncio.new_event_loop()  # never run
    eng = make(tiny, loop=idle)
    row = eng.submit("hi", chat=False, max_tokens=2)

    async def wait_elsewhere():
        return await asyncio.wait_for(row, 5)

    with pytest.raises(RuntimeError) as e:
        asyncio.run(wait_elsewhere())
    assert "not running" in str(e.value) and one_line(str(e.value))
    eng.close()
    idle.close()


# -------------------------------------------------------------------- saving
class _Unwritable:
    def __str__(self):
        raise RuntimeError("cannot be written")

    __repr__ = __str__


def test_save_is_atomic_and_writes_common_python_values(tiny, arun, tmp_path):
    """numpy numbers, dates, paths and stop strings with lone surrogates are saved; a
    save that fails leaves the existing file exactly as it was."""
    np = pytest.importorskip("numpy")

    async def main():
        eng = make(tiny)
        rows = [eng.submit("a", chat=False, max_tokens=3, stop=["\ud800"],
                           tag={"temp": np.float32(0.5), "n": np.int64(3),
                                "on": datetime.date(2024, 5, 1), "dir": Path("/x/y"),
                                "v": np.arange(3)}),
                eng.submit("b", chat=False, max_tokens=3, tag={"bad": _Unwritable()})]
        for r in rows:
            await r
        await eng.aclose()
        return rows

    good_row, bad_row = arun(main)
    target = tmp_path / "out.jsonl"
    Run([good_row]).save(target)
    rec = json.loads(target.read_text(encoding="utf-8"))
    assert (rec["temp"], rec["n"], rec["on"], rec["dir"], rec["v"]) == (
        0.5, 3, "2024-05-01", "/x/y", [0, 1, 2])
    assert rec["params"]["stop"] == ["\ud800"]

    old = "".join(json.dumps({"line": i}) + "\n" for i in range(100))
    target.write_text(old, encoding="utf-8")
    with pytest.raises(RuntimeError, match="cannot be written"):
        Run([good_row, bad_row]).save(target)
    assert target.read_text(encoding="utf-8") == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]  # no temp left


def test_saved_lines_are_strict_json(tiny, arun, tmp_path):
    np = pytest.importorskip("numpy")

    async def main():
        eng = make(tiny)
        def never(text):
            return False

        row = eng.submit("a", chat=False, max_tokens=2, stop=["zz", never], tag={
            "x": float("nan"), "y": np.float32("inf"), "z": [1.5, float("-inf")],
            "w": np.array([np.nan, 2.0])})
        await row
        await eng.aclose()
        return row

    row = arun(main)
    target = Run([row]).save(tmp_path / "out.jsonl")

    def refuse(name):
        raise AssertionError(f"{name} is not JSON")

    rec = json.loads(target.read_text(encoding="utf-8"), parse_constant=refuse)
    assert (rec["x"], rec["y"], rec["z"], rec["w"]) == (None, None, [1.5, None], [None, 2.0])
    assert rec["token_ids"] == row.tokens
    assert rec["params"]["stop"] == ["zz", "<callable test_saved_lines_are_strict_json."
                                           "<locals>.main.<locals>.never>"]


def test_a_saved_row_says_how_its_prompt_was_templated_so_it_can_be_run_again(
        tiny, arun, tmp_path):
    async def main():
        eng = make(tiny)
        runs = [eng.generate(["hello"], chat=False, max_tokens=6),
                eng.generate(["hello"], system="Answer in French.", max_tokens=6),
                eng.generate(["hello"], max_tokens=6)]
        for run in runs:
            await run
        again = []
        for i, run in enumerate(runs):
            rec = json.loads(run.save(tmp_path / f"{i}.jsonl").read_text(encoding="utf-8"))
            row = eng.submit(rec["prompt"], chat=rec["chat"], system=rec["system"],
                             **rec["params"])
            again.append((rec, (await row).tokens))
        await eng.aclose()
        return runs, again

    runs, again = arun(main)
    assert [(rec["chat"], rec["system"]) for rec, _ in again] == [
        (False, None), (True, "Answer in French."), (True, None)]
    for run, (rec, tokens) in zip(runs, again):
        assert tokens == rec["token_ids"] == run.rows[0].tokens
    assert len({tuple(t) for _, t in again}) == 3  # three prompts, templated apart


def test_records_and_saved_lines_use_only_the_columns_sweeps_must_avoid(tiny, arun,
                                                                          tmp_path):
    """A row's tag (its sweep values) is safe from being overwritten only if every
    column the run writes itself is in RECORD_COLUMNS or SAVED_COLUMNS, which
    `%%generate` keeps sweep variables out of."""
    from mlxnb.core.run import RECORD_COLUMNS, SAVED_COLUMNS

    async def main():
        eng = make(tiny)
        rows = [eng.submit("a", chat=False, max_tokens=3, tag={"mine": 1}),
                eng.submit("b", chat=False, max_tokens=50, choices=["abc"], tag={}),
                eng.submit("c", chat=False, max_tokens=3, logprobs=2)]
        for r in rows:
            await r
        await eng.aclose()
        return rows

    rows = arun(main)
    run = Run(rows)
    target = tmp_path / "out.jsonl"
    run.save(target)
    saved = [json.loads(ln) for ln in target.read_text(encoding="utf-8").splitlines()]
    for row, rec, line in zip(rows, run.records(), saved):
        own = set(rec) - set(row.tag or {})
        assert own - RECORD_COLUMNS == set(), own - RECORD_COLUMNS
        assert set(line) - set(rec) <= SAVED_COLUMNS, set(line) - set(rec)
    assert "constraint" in run.records()[1] and saved[0]["mine"] == 1


def _one_row_run(tiny, arun) -> Run:
    async def main():
        eng = make(tiny)
        row = eng.submit("a", chat=False, max_tokens=3)
        await row
        await eng.aclose()
        return row

    return Run([arun(main)])


def test_save_writes_through_links_and_devices_and_refuses_what_it_cannot(tiny, arun,
                                                                           tmp_path):
    run = _one_row_run(tiny, arun)
    real = tmp_path / "real.jsonl"
    real.write_text("old\n", encoding="utf-8")
    link = tmp_path / "link.jsonl"
    link.symlink_to(real)
    assert run.save(link) == link
    assert link.is_symlink() and json.loads(real.read_text(encoding="utf-8"))["text"]
    run.save(os.devnull)  # a character device: written as it is, not replaced
    assert Path(os.devnull).exists() and not Path(os.devnull).is_file()
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for bad, says in (("", "needs a file name"), (tmp_path, "is a directory"),
                      (fifo, "FIFO")):
        with pytest.raises(ValueError, match=says) as e:
            run.save(bad)
        assert "\n" not in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.jsonl", "pipe", "real.jsonl"]


def test_a_finished_run_and_row_await_from_a_later_event_loop(tiny):
    """A script's second asyncio.run awaits what its first finished (and whose loop,
    the engine's, is closed now): the results are all there."""
    async def first():
        eng = make(tiny)
        run = eng.generate(["hello", "abc"], max_tokens=4, chat=False)
        await run
        await eng.aclose()
        return run

    run = asyncio.run(first())

    async def again():
        return await run, await run.rows[1]

    results, row = asyncio.run(again())
    assert [r.text for r in results] == run.texts and row.text == run.rows[1].text


def test_to_dict_of_a_row_whose_stop_function_holds_a_lock(tiny, arun):
    class StopOnX:
        def __init__(self):
            self.lock = threading.Lock()

        def __call__(self, text):
            return "x" in text

    async def main():
        eng = make(tiny)
        res = await eng.submit("hello", chat=False, max_tokens=4, stop=[StopOnX()],
                               logprobs=1)
        await eng.aclose()
        return res

    res = arun(main)
    d = res.to_dict()
    assert d["text"] == res.text and d["params"]["stop"] == res.params["stop"]
    d["logprobs"][0]["token"] = "changed"  # a copy: the result stays as it was
    assert res.logprobs[0]["token"] != "changed"


def test_a_tag_never_overwrites_the_runs_own_columns_and_any_tag_saves(tiny, arun,
                                                                        tmp_path):
    tags = [{"text": "MY LABEL", "finish_reason": "x", "params": 1, "mine": 2},
            {(1, 2): "tuple key", "grid": {(0.2, 1): "cell"}}, "a plain label"]

    async def main():
        eng = make(tiny)
        rows = [eng.submit("hello", chat=False, max_tokens=3, tag=t) for t in tags]
        await eng.wait()
        await eng.aclose()
        return Run(rows)

    run = arun(main)
    rows, recs = run.rows, run.records()
    assert recs[0]["text"] == rows[0].text and recs[0]["finish_reason"] == "length"
    assert (recs[0]["tag_text"], recs[0]["tag_finish_reason"], recs[0]["mine"]) == (
        "MY LABEL", "x", 2)
    assert recs[2]["tag"] == "a plain label"
    saved = [json.loads(ln) for ln in
             run.save(tmp_path / "t.jsonl").read_text(encoding="utf-8").splitlines()]
    assert saved[0]["text"] == rows[0].text and saved[0]["tag_params"] == 1
    assert isinstance(saved[0]["params"], dict)
    assert saved[1]["(1, 2)"] == "tuple key" and saved[1]["grid"] == {"(0.2, 1)": "cell"}
    assert saved[2]["tag"] == "a plain label"
    # a tag that says what the run writes itself is said once (an adapter sweep's)
    rows[0].tag = {"adapter": "base"}
    rows[1].tag = {"adapter": "other"}
    recs = Run(rows[:2], meta={"adapters": {}}).records()
    assert recs[0]["adapter"] == "base" and "tag_adapter" not in recs[0]
    assert (recs[1]["adapter"], recs[1]["tag_adapter"]) == ("base", "other")


def test_save_keeps_a_files_permissions_takes_long_names_and_home_and_says_what_is_wrong(
        tiny, arun, tmp_path, monkeypatch):
    run = _one_row_run(tiny, arun)
    private = tmp_path / "private.jsonl"
    private.write_text("old\n", encoding="utf-8")
    private.chmod(0o600)
    run.save(private)
    assert stat.S_IMODE(private.stat().st_mode) == 0o600 and private.read_text() != "old\n"
    longest = tmp_path / ("x" * 245 + ".jsonl")  # 251 characters: a valid name
    assert run.save(longest) == longest and longest.read_text()
    monkeypatch.setenv("HOME", str(tmp_path))
    assert run.save("~/home.jsonl") == tmp_path / "home.jsonl"
    assert (tmp_path / "home.jsonl").read_text()
    for bad, says in ((tmp_path / "missing" / "run.jsonl", "does not exist; create it"),
                      (None, "needs a file name"), (123, "needs a file name")):
        with pytest.raises(ValueError, match=says) as e:
            run.save(bad)
        assert "\n" not in str(e.value) and ".tmp" not in str(e.value)


# ------------------------------------------------------------- special files
@pytest.mark.parametrize("victim", ["model.safetensors", "tokenizer.json"])
def test_a_fifo_in_a_model_directory_is_refused(tmp_path, victim):
    """A FIFO where a weights or tokenizer file should be is refused with a one-line
    error; reading it would block the whole process, interrupts included."""
    d = save_tiny_model(tmp_path / "m")
    assert (d / victim).exists()
    (d / victim).unlink()
    os.mkfifo(d / victim)
    code = textwrap.dedent(f"""
        import asyncio
        from mlxnb import Engine
        async def main():
            try:
                Engine({str(d)!r}, kv_budget=None)
            except Exception as e:
                print("ERR", type(e).__name__, str(e))
        asyncio.run(main())
    """)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    try:
        p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("loading a directory with a FIFO blocked")
    line = p.stdout.strip()
    assert line.startswith("ERR ModelLoadError") and "FIFO" in line and victim in line
    assert one_line(line), p.stdout + p.stderr


# ------------------------------------------------------------- chat templates
def templated(template: str):
    model, tok = tiny_model()
    tok._tokenizer.chat_template = template
    return model, tok


@pytest.mark.parametrize("template,error", [
    ("{{ raise_exception('no system role') }}", "TemplateError"),
    ("{{ messages[0].nope.deeper }}", "UndefinedError"),
    ("{{ ''.__class__.__mro__ }}", "SecurityError"),
    ("{% for m in messages %}{{ m.content }", "TemplateSyntaxError"),
])
def test_chat_template_errors_are_one_line(arun, template, error):
    async def main():
        eng = make(templated(template))
        with pytest.raises(ValueError) as e:
            eng.submit("hi", max_tokens=2)
        raw = await eng.submit("hi", chat=False, max_tokens=2)
        await eng.aclose()
        return str(e.value), raw

    msg, raw = arun(main)
    assert one_line(msg) and error in msg and "chat=False" in msg
    assert raw.finish_reason == "length"


def test_a_runaway_chat_template_is_stopped(arun):
    """A template with loops of 10^15 iterations is stopped within its bound, the row
    refused, the render thread gone, and running rows carry on."""
    loop3 = ("{% for a in range(100000) %}{% for b in range(100000) %}"
             "{% for c in range(100000) %}{% endfor %}{% endfor %}{% endfor %}")

    async def main():
        eng = make(templated(loop3))
        row = eng.submit("a running row", chat=False, max_tokens=200)
        await asyncio.sleep(0.2)
        t = time.perf_counter()
        with pytest.raises(ValueError) as e:
            eng.submit("hi", max_tokens=2)
        took = time.perf_counter() - t
        res = await asyncio.wait_for(row, 20)
        await eng.aclose()
        return str(e.value), took, res

    before = threading.active_count()
    msg, took, res = arun(main)
    assert took < 5 and one_line(msg) and "chat=False" in msg
    assert res.finish_reason == "length" and len(res.tokens) == 200
    for _ in range(100):
        if not any(t.name == "mlxnb-template" for t in threading.enumerate()):
            break
        time.sleep(0.05)
    assert not any(t.name == "mlxnb-template" for t in threading.enumerate())
    assert threading.active_count() <= before + 1


# --------------------------------------------------------------- huge prompts
def test_a_huge_prompt_is_refused_before_tokenizing(tiny, arun):
    """A 5 MB prompt cannot fit the context in any tokenization: refused in
    milliseconds (tokenizing it first stalled every row for seconds)."""

    async def main():
        eng = make(tiny)
        big = "word " * 1_000_000
        t = time.perf_counter()
        with pytest.raises(ValueError) as e:
            eng.prepare(big, chat=False, max_tokens=4)
        row = eng.submit(big, max_tokens=4)
        took = time.perf_counter() - t
        await eng.aclose()
        return str(e.value), took, row

    msg, took, row = arun(main)
    assert took < 0.5, f"refusing took {took:.2f} s"
    assert one_line(msg) and "context" in msg and "shorten" in msg
    assert row.finish_reason == "error" and "context" in row.error


# ------------------------------------------------------------- extreme sampling
@pytest.mark.parametrize("params", [dict(temperature=1e-39), dict(temperature=1e-30),
                                    dict(temperature=1.0, top_p=1e-46),
                                    dict(temperature=1.0, top_p=1e-300),
                                    dict(temperature=1.0, top_p=1e-9),
                                    dict(temperature=0.7, top_k=1)])
def test_vanishing_temperature_or_top_p_is_greedy(tiny, arun, params):
    async def main():
        eng = make(tiny)
        greedy = eng.submit("same prompt", chat=False, max_tokens=12)
        other = eng.submit("same prompt", chat=False, max_tokens=12, seed=5, **params)
        res = [await greedy, await other]
        await eng.aclose()
        return res

    greedy, other = arun(main)
    assert other.tokens == greedy.tokens and len(set(greedy.tokens)) > 1


# ------------------------------------------------------------------ the widget
def test_a_stop_message_with_an_odd_row_id_is_ignored(tiny, arun, caplog):
    """Front-end messages are untrusted: a stop naming a list or a dict stops nothing
    and raises nothing (in a kernel, a raise is a traceback on iopub)."""
    import logging

    from mlxnb.notebook.widget import GenerationWidget

    caplog.set_level(logging.DEBUG)

    async def main():
        eng = make(tiny)
        run = eng.generate(["a", "b"], chat=False, max_tokens=400)
        w = GenerationWidget(eng, run.rows)
        for rid in ([0], {"id": 0}, None, "0", 1.5, [[1]]):
            w._handle_custom_msg({"type": "stop", "id": rid}, [])
        await asyncio.sleep(0.1)
        untouched = [r.done for r in run.rows]
        w._handle_custom_msg({"type": "stop", "id": run.rows[0].id}, [])
        res = await asyncio.wait_for(run, 20)
        w.close()
        await eng.aclose()
        return untouched, [r.finish_reason for r in res]

    untouched, reasons = arun(main)
    assert untouched == [False, False] and reasons == ["cancelled", "length"]
    assert not [r for r in caplog.records if r.exc_info], caplog.text


# ------------------------------------------------------------------ the magics
@pytest.fixture
def shell(tiny):
    from IPython.core.interactiveshell import InteractiveShell

    from mlxnb.notebook import magics

    ip = InteractiveShell.instance()
    magics.load_ipython_extension(ip)
    magics.use(make(tiny, loop=asyncio.new_event_loop()), "tiny")
    yield ip
    eng = magics.get_engine()
    magics._S.engine = None
    if eng is not None:
        eng.close()
        eng.loop.close()
    magics.unload_ipython_extension(ip)


@pytest.mark.parametrize("name", ["__builtins__", "_oh", "get_ipython", "In", "Out",
                                  "exit", "quit", "print", "_", "__", "_i", "_ii", "_i3",
                                  "_5", "_dh", "__name__"])
def test_run_names_that_python_or_ipython_rely_on_are_refused(shell, name):
    from IPython.core.error import UsageError

    before = shell.user_ns.get(name, KeyError)
    res = shell.run_cell(f"%%generate -o {name} --quiet --max-tokens 2\nhi")
    assert isinstance(res.error_in_exec, UsageError), res.error_in_exec
    assert one_line(str(res.error_in_exec)) and name in str(res.error_in_exec)
    assert shell.user_ns.get(name, KeyError) is before
    ok = shell.run_cell("%%generate -o my_run --quiet --max-tokens 2\nhi")
    assert ok.success and shell.user_ns["my_run"].rows


def test_magic_errors_for_templates_and_huge_prompts_are_one_line(shell, tiny):
    from IPython.core.error import UsageError

    from mlxnb.notebook import magics

    magics.use(make(templated("{{ messages[0].nope.deeper }}"),
                    loop=asyncio.new_event_loop()), "tiny")
    res = shell.run_cell("%%generate --quiet --max-tokens 2\nhi")
    assert isinstance(res.error_in_exec, UsageError) and one_line(str(res.error_in_exec))
    assert "UndefinedError" in str(res.error_in_exec)
    shell.user_ns["huge"] = "word " * 1_000_000
    t = time.perf_counter()
    res = shell.run_cell("%%generate --quiet --raw --max-tokens 2\n{huge}")
    assert time.perf_counter() - t < 1.0
    assert isinstance(res.error_in_exec, UsageError) and one_line(str(res.error_in_exec))
    assert "context" in str(res.error_in_exec)


# ------------------------------------------------------------------ a real kernel
@pytest.mark.integration
def test_in_a_kernel_a_thread_built_engine_serves_and_reserved_names_are_refused(tmp_path):
    """In a real kernel an Engine built on a background thread serves on the kernel's
    loop (it bound a fresh loop nobody ran: `await row` hung), and `-o __builtins__`
    is refused with the kernel left working."""
    pytest.importorskip("jupyter_client")
    from _jupyter import python_kernel

    tiny_dir = save_tiny_model(tmp_path / "tiny")
    with python_kernel() as cell:
        def run(code, timeout=60):
            return cell.run(code, timeout)[:2]

        status, out = run(textwrap.dedent(f"""
            import asyncio, threading, mlxnb
            box = []
            th = threading.Thread(target=lambda: box.append(
                mlxnb.Engine({str(tiny_dir)!r}, kv_budget=None)))
            th.start(); th.join()
            r = await asyncio.wait_for(box[0].submit('hi', chat=False, max_tokens=4), 20)
            print('FINISH', r.finish_reason)
        """))
        assert status == "ok" and "FINISH length" in out, out
        run("%load_ext mlxnb")
        run("import mlxnb.notebook.magics as _m; _m.use(box[0], 'tiny')")
        status, out = run("%%generate -o __builtins__ --quiet --max-tokens 2\nhi")
        assert status == "error" and "UsageError" in out and "__builtins__" in out, out
        status, out = run("print('alive', len([1, 2]))")
        assert status == "ok" and "alive 2" in out, out
