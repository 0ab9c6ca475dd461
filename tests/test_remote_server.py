"""The server engine against a real `mlx_lm.server` in a subprocess (tiny random model;
the default model under `e2e`): a %%generate through a real kernel, cancel mid-stream,
a server killed mid-run and restarted, a wrong model name, seeded rows."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from _jupyter import free_port, kernel_env  # tests/ is on sys.path under pytest
from mlxnb.models.blas import blas_env
from mlxnb.remote import connect

pytestmark = [pytest.mark.server, pytest.mark.integration]  # real server subprocesses


@contextlib.contextmanager
def mlx_lm_server(model_dir, log_path: Path, port: int | None = None, hf_hub: bool = True):
    """`mlx_lm.server --model model_dir` on a free port; yields (url, Popen). With
    `hf_hub`, an empty Hugging Face cache of its own (so GET /v1/models lists just the
    model); without, no cache at all (its /v1/models then fails, as on a fresh machine).
    Offline either way, so a model it does not have fails at once."""
    port = port or free_port()
    hf = log_path.parent / f"hf-{port}"
    if hf_hub:
        (hf / "hub").mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, HF_HOME=str(hf), HF_HUB_OFFLINE="1")
    env.update(blas_env(env))  # OpenBLAS under the server's MLX too, as under ours (Linux CPU)
    log = open(log_path, "ab")
    proc = subprocess.Popen([sys.executable, "-m", "mlx_lm", "server", "--model", str(model_dir),
                             "--host", "127.0.0.1", "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, f"mlx_lm.server exited: {log_path.read_text()[-2000:]}"
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "mlx_lm.server did not start in 90 s"
            time.sleep(0.2)
        yield url, proc
    finally:
        kill(proc)
        log.close()


def kill(proc):
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from mlxnb.models.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    with mlx_lm_server(tiny_dir, log) as (url, proc):
        yield url, proc


def run_async(fn, timeout=120):
    return asyncio.run(asyncio.wait_for(fn(), timeout))


def test_seeded_rows_give_the_same_text_twice(server, tiny_dir):
    url, _ = server

    async def main():
        eng = connect(url)
        assert eng.model == str(Path(tiny_dir).resolve())  # the one model it lists
        kw = dict(max_tokens=24, temperature=1.0)
        a = await eng.submit("same seed", seed=11, **kw)
        b = await eng.submit("same seed", seed=11, **kw)
        c = await eng.submit("same seed", seed=12, **kw)
        # mlx_lm.server takes at most 11 top logprobs: that row alone ends, with its reason
        rejected, fine = eng.submit("too many", logprobs=15), eng.submit("fine", max_tokens=4)
        assert (await rejected).finish_reason == "error" and (await fine).finish_reason == "length"
        await eng.aclose()
        assert rejected.error == ("the server rejected the request: top_logprobs must be at "
                                  "most 11")
        return a, b, c

    a, b, c = run_async(main)
    assert a.finish_reason == b.finish_reason == "length" and a.text and a.seed == 11
    assert a.text == b.text
    assert c.text != a.text


def test_cancel_mid_stream_stops_the_server(server):
    url, proc = server

    async def main():
        eng = connect(url)
        row = eng.submit("go on forever", max_tokens=100_000)
        t0 = time.monotonic()
        while row.ntok < 20:
            assert time.monotonic() - t0 < 30, f"no tokens: {row}"
            await asyncio.sleep(0.02)
        busy0, tb = cpu_seconds(proc.pid), time.monotonic()
        await asyncio.sleep(1.0)
        busy = (cpu_seconds(proc.pid) - busy0) / (time.monotonic() - tb)
        row.cancel()
        res = await row
        await asyncio.sleep(0.5)  # the server notices at its next write
        idle0, ti = cpu_seconds(proc.pid), time.monotonic()
        await asyncio.sleep(1.0)
        idle = (cpu_seconds(proc.pid) - idle0) / (time.monotonic() - ti)
        await eng.aclose()
        return res, busy, idle

    res, busy, idle = run_async(main)
    assert res.finish_reason == "cancelled" and res.text
    # generating, the server kept a core busy (as much as 2 shared cores allow); once
    # the stream is closed it idles
    assert idle < min(0.08, busy / 3), (busy, idle)


def test_killed_server_ends_rows_with_a_reason_and_a_restart_serves_again(tiny_dir, tmp_path):
    port = free_port()
    log = tmp_path / "server.log"

    async def main():
        with mlx_lm_server(tiny_dir, log, port, hf_hub=False) as (url, proc):
            eng = connect(url, max_concurrency=2, retries=2)
            assert eng.model is None  # no model list: the server's default model
            run = eng.generate([f"row {i}" for i in range(4)], max_tokens=100_000)
            while min(r.ntok for r in run.rows[:2]) < 5:
                await asyncio.sleep(0.02)
            kill(proc)
            res = await run
        # the same engine, once the server is back on its address
        with mlx_lm_server(tiny_dir, log, port, hf_hub=False) as (url, proc):
            again = await eng.submit("back again", max_tokens=8)
            other = connect(url, model="nope/not-a-model")  # no listing: the row says it
            wrong = await other.submit("hi", max_tokens=4)
            await eng.aclose()
            await other.aclose()
        return res, again, wrong

    res, again, wrong = run_async(main)
    assert [r.finish_reason for r in res] == ["error"] * 4
    streaming, queued = res[:2], res[2:]
    for r in streaming:
        assert r.text and ("without a finish reason" in r.error or "mid-stream" in r.error)
    for r in queued:
        assert "could not reach the server" in r.error and "after 3 attempts" in r.error
    assert again.finish_reason == "length" and again.text
    assert wrong.finish_reason == "error"
    assert "does not know model 'nope/not-a-model'" in wrong.error and "--model" in wrong.error


def test_a_model_the_server_does_not_list_is_refused_at_connect(server):
    url, _ = server
    with pytest.raises(ValueError, match="does not serve model 'nope'; it lists"):
        connect(url, model="nope")


# -- through a real kernel ---------------------------------------------------------------
def execute(kc, code: str, timeout: float = 120) -> str:
    """Run a cell; its stdout. Fails on an error reply or anything on stderr."""
    out, err = [], []

    def hook(msg):
        c = msg["content"]
        if msg["msg_type"] == "stream":
            (out if c["name"] == "stdout" else err).append(c["text"])
        elif msg["msg_type"] == "error":
            err.append("\n".join(c["traceback"]))

    reply = kc.execute_interactive(code, timeout=timeout, output_hook=hook)
    assert reply["content"]["status"] == "ok" and not err, (code, reply["content"], err)
    return "".join(out)


def test_generate_cell_through_a_kernel_against_the_server(server, tiny_dir, tmp_path):
    jupyter_client = pytest.importorskip("jupyter_client")
    url, _ = server
    secret = "sk-kernel-secret-31337"
    env = kernel_env()
    env["MLXNB_TEST_KEY"] = secret
    km = jupyter_client.KernelManager(kernel_name="python3")
    km.start_kernel(env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kc = km.client()
    kc.start_channels()
    saved = tmp_path / "run.jsonl"
    try:
        kc.wait_for_ready(timeout=60)
        outs = [execute(kc, "%load_ext mlxnb")]
        outs.append(execute(kc, f"%mlxnb connect {url} --api-key-env MLXNB_TEST_KEY "
                                "--max-concurrency 3"))
        assert "connected to" in outs[-1] and "not reported by this server" in outs[-1]
        outs.append(execute(kc, "%%generate --max-tokens 12 -o run\n"
                                + "\n".join(f"prompt number {i}" for i in range(6))))
        outs.append(execute(kc, "import json\nres = await run\n"
                                "print('ROWS', json.dumps([[r.finish_reason, r.text, r.error] "
                                "for r in res]))\n"
                                "print('NTOK', json.dumps([r.ntok for r in run.rows]))\n"
                                "df = run.to_pandas(); print('DF', df.shape, list(df.tokens))\n"
                                f"run.save({str(saved)!r})\n"
                                "print('WIDGET', run.widget.header['kv_unit'], "
                                "run.widget.header['batch_reported'], len(run.widget.rows))"))
        out = outs[-1]
        rows = json.loads(out.split("ROWS ", 1)[1].splitlines()[0])
        assert [r[0] for r in rows] == ["length"] * 6 and all(r[1] for r in rows), rows
        assert json.loads(out.split("NTOK ", 1)[1].splitlines()[0]) == [12] * 6
        assert "DF (6," in out and "WIDGET None False 6" in out
        outs.append(execute(kc, "%mlxnb status"))
        assert "streaming 0, queued 0, done 6" in outs[-1]
        # back to a local model: the same cell runs in this process
        outs.append(execute(kc, f"%mlxnb load {tiny_dir}"))
        outs.append(execute(kc, "%%generate --max-tokens 4 --quiet -o loc\nlocal row"))
        outs.append(execute(kc, "r = await loc\nimport mlxnb.notebook.magics as m\n"
                                "print('LOCAL', r[0].finish_reason, "
                                "type(m.get_engine()).__name__)"))
        assert "LOCAL length Engine" in outs[-1]
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    assert saved.exists()
    for text in outs + [saved.read_text()]:
        assert secret not in text


# -- the default model ------------------------------------------------------------------
@pytest.mark.e2e
def test_default_model_server(tmp_path):
    from mlxnb.models.loading import default_model_path

    with mlx_lm_server(default_model_path(), tmp_path / "server.log") as (url, _):

        async def main():
            eng = connect(url, max_concurrency=4)
            run = eng.generate(["Name three prime numbers.", "What is the capital of France?",
                                "Write a haiku about the sea.", "Say hello."], max_tokens=24)
            res = await run
            seeded = [await eng.submit("Tell me a story.", max_tokens=16, temperature=0.8,
                                       seed=5) for _ in range(2)]
            await eng.aclose()
            return res, seeded

        res, seeded = run_async(main, timeout=300)
    assert all(r.finish_reason in ("stop", "length") and r.text.strip() for r in res), res
    assert "Paris" in res[1].text
    assert all(r.ttft_s is not None and r.prompt_tokens > 0 for r in res)
    assert seeded[0].text == seeded[1].text and seeded[0].text
