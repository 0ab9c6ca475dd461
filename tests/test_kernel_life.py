"""Interrupts, restart and shutdown of a REAL kernel.

One ipykernel (jupyter_client `KernelManager`, this checkout on PYTHONPATH, its stderr
captured in a file) serves the whole module, on the tiny random-weight model saved to
a directory. Greedy tiny rows never emit <eos>, so every row runs to --max-tokens
(~400 tokens/s per row here) unless it is stopped: finish reasons are predictable.

* interrupt while idle: SIGINT is ignored, rows keep generating; `%mlxnb stop all`
  then ends them all 'cancelled';
* interrupt during a synchronous cell: KeyboardInterrupt hits that cell only; the rows
  finish normally afterwards;
* interrupt during `await run` (and `await mlxnb.wait()`): the awaiting cell is
  cancelled, the rows keep generating (shielded), a later `await run` returns them all;
* restart: the magics are gone until `%load_ext mlxnb` again, then `%%generate` works;
* shutdown mid-generation: `shutdown_kernel(now=False)` returns quickly, the kernel
  exits by itself (not killed), and its stderr holds no traceback.

The tests run in file order and share the kernel; each leaves no row running.
"""

from __future__ import annotations

import json
import queue
import re
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
jupyter_client = pytest.importorskip("jupyter_client")

from _jupyter import kernel_env  # noqa: E402  (tests/ is on sys.path under pytest)

CELL_TIMEOUT = 30.0

# What a row looks like from outside: one JSON line per probe.
PROBE = ("import json as _j\n"
         "print('ROWS ' + _j.dumps([[r.state, r.finish_reason, r.ntok] for r in {run}.rows]"
         "), flush=True)")


class Kernel:
    """A thin synchronous driver: send a cell, watch its output, get its reply."""

    def __init__(self, km, stderr_path: Path):
        self.km = km
        self.stderr_path = stderr_path
        self.stderr_seen = 0  # offset of the kernel's stderr file already checked
        self.stray = []  # stderr text / errors on iopub that belong to no cell of ours
        self.kc = None
        self.connect()

    def connect(self):
        if self.kc is not None:
            self.kc.stop_channels()
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)

    def send(self, code: str) -> dict:
        return {"id": self.kc.execute(code), "out": [], "stdout": "", "idle": False}

    def _pump(self, cell: dict, deadline: float) -> None:
        """Read one iopub message (this cell's ones are recorded)."""
        try:
            msg = self.kc.get_iopub_msg(timeout=max(0.01, min(0.2, deadline - time.monotonic())))
        except queue.Empty:
            return
        kind, content = msg["msg_type"], msg["content"]
        if cell is None or msg["parent_header"].get("msg_id") != cell["id"]:
            # widget traffic of older cells, status of other requests; but a traceback
            # from a background task (asyncio's "exception was never retrieved") lands
            # here, on stderr with some other cell's header: keep those.
            if kind == "error" or kind == "stream" and content["name"] == "stderr":
                self.stray.append(content)
            return
        cell["out"].append((kind, content))
        if kind == "stream" and content["name"] == "stdout":
            cell["stdout"] += content["text"]
        if kind == "status" and content["execution_state"] == "idle":
            cell["idle"] = True

    def wait_stdout(self, cell: dict, text: str, timeout: float = CELL_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while text not in cell["stdout"]:
            assert not cell["idle"], f"cell ended before printing {text!r}: {cell['out']}"
            assert time.monotonic() < deadline, f"no {text!r} within {timeout} s"
            self._pump(cell, deadline)

    def finish(self, cell: dict, timeout: float = CELL_TIMEOUT) -> dict:
        """Wait for the cell's execute_reply and idle status; return the reply content."""
        deadline = time.monotonic() + timeout
        reply = None
        while reply is None:
            assert time.monotonic() < deadline, f"no reply within {timeout} s: {cell['out']}"
            try:
                msg = self.kc.get_shell_msg(timeout=0.2)
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") == cell["id"]:
                reply = msg["content"]
        while not cell["idle"]:
            assert time.monotonic() < deadline, "no idle status after the reply"
            self._pump(cell, deadline)
        cell["reply"] = reply
        return reply

    def run(self, code: str, ok: bool = True, timeout: float = CELL_TIMEOUT) -> dict:
        cell = self.send(code)
        reply = self.finish(cell, timeout)
        if ok:
            assert reply["status"] == "ok", (code, reply.get("ename"), reply.get("evalue"),
                                             errors(cell))
            assert not errors(cell), errors(cell)
        return cell

    def rows(self, run: str) -> list:
        """[[state, finish_reason, ntok], ...] of the Run variable `run`."""
        out = self.run(PROBE.format(run=run))["stdout"]
        line = next(ln for ln in out.splitlines() if ln.startswith("ROWS "))
        return json.loads(line[5:])

    def wait_tokens(self, run: str, at_least: int, timeout: float = 15.0) -> list:
        deadline = time.monotonic() + timeout
        while True:
            rows = self.rows(run)
            if min(r[2] for r in rows) >= at_least:
                return rows
            assert time.monotonic() < deadline, f"rows stuck at {rows}"
            time.sleep(0.1)

    def new_stderr(self) -> str:
        """The kernel's stderr (file) written since the last call."""
        text = self.stderr_path.read_text(errors="replace")
        new, self.stderr_seen = text[self.stderr_seen:], len(text)
        return new

    def assert_quiet(self, noise=()) -> None:
        """Nothing unexpected on the kernel's stderr file or on iopub since last time."""
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline:  # drain what is still in flight
            self._pump(None, deadline)
        stray, self.stray = self.stray, []
        assert not stray, stray
        text = self.new_stderr()
        bad = unexpected_stderr(text, noise)
        assert not bad, text


def errors(cell: dict) -> list:
    return [c for k, c in cell["out"] if k == "error"] + [
        c["text"] for k, c in cell["out"] if k == "stream" and c["name"] == "stderr"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from mlxnb.models.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="module")
def kernel(tiny_dir, tmp_path_factory):
    from jupyter_client import KernelManager

    stderr_path = tmp_path_factory.mktemp("kernel") / "stderr.txt"
    log = open(stderr_path, "w")
    km = KernelManager(kernel_name="python3")
    km.start_kernel(env=kernel_env(), stdout=log, stderr=log)
    k = Kernel(km, stderr_path)
    try:
        k.run("%load_ext mlxnb")
        k.run(f"%mlxnb load {tiny_dir}")
        yield k
    finally:
        k.kc.stop_channels()
        if km.has_kernel:
            km.shutdown_kernel(now=True)
        log.close()


# Kernel stderr that is not ours: the TCP warning at every start, and zmq's
# "gc socket requested during shutdown" traceback under heavy iopub traffic.
KNOWN_NOISE = [
    r"\[IPKernelApp\] WARNING \| Kernel is running over TCP without encryption\..*\n",
    r"Traceback \(most recent call last\):\n(?:[ \t].*\n)*.*gc socket requested during "
    r"shutdown.*\n",
]
# ipykernel, not mlxnb: a kernel shut down while an async cell awaits AND a background
# task keeps the loop busy (any `run_in_executor` loop does it, no mlxnb needed) tries
# to send that cell's execute_reply on the closed shell socket and logs this.
REPLY_AFTER_CLOSE = (
    r"\[IPKernelApp\] ERROR \| Exception in message handler:\n"
    r"Traceback \(most recent call last\):\n(?:[ \t].*\n)*?.*in execute_request\n"
    r"(?:[ \t].*\n)*zmq\.error\.ZMQError: Socket operation on non-socket\n")
SUSPICIOUS = re.compile(r"Traceback|Error|Exception|Task was destroyed|never awaited|"
                        r"Warning|WARNING")


def unexpected_stderr(text: str, extra_noise=()) -> list:
    """Lines of the kernel's stderr that look like trouble, once known noise is cut."""
    for pat in [*KNOWN_NOISE, *extra_noise]:
        text = re.sub(pat, "", text)
    return [ln for ln in text.splitlines() if SUSPICIOUS.search(ln)]


# -- interrupts ------------------------------------------------------------------------
def test_interrupt_while_idle_is_ignored_and_stop_all_ends_the_rows(kernel):
    kernel.run("%%generate --quiet --max-tokens 4000 -o idle_run\nhello\nworld")
    before = kernel.wait_tokens("idle_run", 20)
    kernel.km.interrupt_kernel()  # SIGINT to an idle kernel
    time.sleep(0.5)
    after = kernel.rows("idle_run")
    assert all(r[0] == "decode" and r[1] is None for r in after), after
    assert min(a[2] for a in after) > max(b[2] for b in before), (before, after)
    kernel.run("import mlxnb.notebook.magics as _m\n"
               "assert not _m.get_engine()._task.done(), 'the serving task died'")

    out = kernel.run("%mlxnb stop all")["stdout"]
    assert "stopping 2 rows" in out
    kernel.run("_res = await idle_run\n"
               "assert [x.finish_reason for x in _res] == ['cancelled'] * 2, _res")
    rows = kernel.rows("idle_run")
    assert all(r[:2] == ["done", "cancelled"] and 0 < r[2] < 4000 for r in rows), rows
    kernel.assert_quiet()


def test_interrupt_hits_only_the_busy_sync_cell(kernel):
    kernel.run("%%generate --quiet --max-tokens 600 -o sync_run\nhello\nworld")
    cell = kernel.send("import time\nprint('SLEEPING', flush=True)\n"
                       "time.sleep(5)\nprint('WOKE')")
    kernel.wait_stdout(cell, "SLEEPING")
    t0 = time.monotonic()
    time.sleep(0.2)
    kernel.km.interrupt_kernel()
    reply = kernel.finish(cell)
    assert time.monotonic() - t0 < 4, "the interrupt did not cut the sleep short"
    assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt", reply
    assert "WOKE" not in cell["stdout"]
    # the rows were not touched: they finish normally, every token there
    kernel.run("_res = await sync_run\n"
               "assert [x.finish_reason for x in _res] == ['length'] * 2, _res")
    rows = kernel.rows("sync_run")
    assert rows == [["done", "length", 600]] * 2, rows
    kernel.assert_quiet()


def test_interrupt_of_an_awaiting_cell_leaves_the_rows_running(kernel):
    kernel.run("%%generate --max-tokens 2500 -o aw\nhello\nworld")  # with its widget
    for waiter in ("_res = await aw", "await mlxnb.wait()"):
        kernel.wait_tokens("aw", 1)
        cell = kernel.send(f"import mlxnb\nprint('AWAITING', flush=True)\n{waiter}\n"
                           "print('RETURNED')")
        kernel.wait_stdout(cell, "AWAITING")
        time.sleep(0.3)
        kernel.km.interrupt_kernel()
        reply = kernel.finish(cell, timeout=5)  # cancelled now, not when rows finish
        assert reply["status"] == "error", reply
        assert reply["ename"] in ("KeyboardInterrupt", "CancelledError"), reply
        assert "RETURNED" not in cell["stdout"]
        rows = kernel.rows("aw")
        assert all(r[0] == "decode" and r[1] is None for r in rows), (waiter, rows)
        later = kernel.wait_tokens("aw", max(r[2] for r in rows) + 1)
        assert all(r[1] is None or r[1] == "length" for r in later), later
    kernel.run("_res = await aw\n"
               "assert [x.finish_reason for x in _res] == ['length'] * 2, _res\n"
               "assert [len(x.tokens) for x in _res] == [2500] * 2")
    kernel.assert_quiet()


# -- errors must reach the front end -------------------------------------------------------
def test_usage_error_echoing_a_lone_surrogate_still_gets_a_reply(kernel):
    """ipykernel cannot serialize a lone surrogate: an error message holding one (user
    text echoed back) must not leave the cell without an execute_reply (hung)."""
    kernel.run("_bad = 'bad' + chr(0xd800) + 'id'")
    for cell, says in [("%%generate --quiet --model $_bad\nhi", "load bad\\ud800id"),
                       ("%%generate --quiet $_bad\nhi", "arguments: bad\\ud800id"),
                       ("%%generate --quiet\n{_bad}", "invalid unicode"),
                       ("%mlxnb stop $_bad", "'bad\\ud800id' is not a Run")]:
        reply = kernel.run(cell, ok=False, timeout=5)["reply"]  # not hung
        assert reply["status"] == "error" and reply["ename"] == "UsageError", reply
        assert says in reply["evalue"], reply  # escaped, visible
    kernel.assert_quiet()


# -- restart and shutdown ------------------------------------------------------------------
def restart(kernel, label: str) -> None:
    # jupyter_client kills a kernel that has not exited by shutdown_wait_time (5 s by
    # default): longer here, so a loaded machine's slow exit is not taken for a hang
    kernel.km.shutdown_wait_time = 20
    t0 = time.monotonic()
    kernel.km.restart_kernel(now=False)
    dt = time.monotonic() - t0
    kernel.connect()
    print(f"\nrestart {label}: {dt:.2f} s")
    assert dt < 10, f"restart {label} took {dt:.1f} s"
    cell = kernel.run("%%generate --quiet\nhello", ok=False)
    assert cell["reply"]["status"] == "error"  # a new process: the magics are gone
    assert "not found" in cell["reply"]["evalue"], cell["reply"]


def test_restart_then_load_ext_again_and_generate(kernel, tiny_dir):
    # 1. rows generating, kernel idle
    kernel.run("%%generate --max-tokens 4000 -o doomed\nhello\nworld")  # widget on
    kernel.wait_tokens("doomed", 20)
    restart(kernel, "mid-generation")
    kernel.run("%load_ext mlxnb")
    kernel.run(f"%%generate --max-tokens 4000 --model {tiny_dir} -o again\nhello")
    kernel.wait_tokens("again", 20)
    kernel.assert_quiet()

    # 2. rows generating and a cell awaiting them
    busy = kernel.send("print('AWAITING', flush=True)\nawait again")
    kernel.wait_stdout(busy, "AWAITING")
    restart(kernel, "mid-generation with a cell awaiting")
    kernel.run("%load_ext mlxnb")
    kernel.run(f"%%generate --max-tokens 50 --model {tiny_dir} -o third\nhello\nworld")
    kernel.run("_res = await third\n"
               "assert [x.finish_reason for x in _res] == ['length'] * 2, _res")
    kernel.assert_quiet(noise=[REPLY_AFTER_CLOSE])


def test_shutdown_mid_generation_is_quick_and_clean(kernel):
    km = kernel.km
    kernel.run("%%generate --max-tokens 4000 -o mid\nhello\nworld\nagain")  # widget on
    kernel.wait_tokens("mid", 50)
    kernel.assert_quiet()
    proc = km.provisioner.process  # the kernel's Popen
    km.shutdown_wait_time = 20  # (see restart)
    t0 = time.monotonic()
    km.shutdown_kernel(now=False)
    dt = time.monotonic() - t0
    print(f"\nshutdown mid-generation: {dt:.2f} s, exit code {proc.returncode}")
    assert dt < 10, f"shutdown took {dt:.1f} s"
    assert proc.returncode == 0, "the kernel did not exit by itself (killed?)"
    text = kernel.new_stderr()
    assert not unexpected_stderr(text), text
