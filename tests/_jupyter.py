"""A headless, isolated JupyterLab 4 or Notebook 7 server for browser tests.

Everything the server and its kernels write (config, runtime files, workspaces, user
settings) lives under one temporary directory, so a test neither reads nor changes
the user's Jupyter set-up. The server is killed (its whole process group) when the
context manager exits, whatever happened.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# JupyterLab user settings for a quiet, deterministic test page: no news or update
# checks (no network here), and no notebook windowing, so every output stays in the
# DOM and keeps its size (windowing can blank canvases scrolled off screen).
_SETTINGS = {
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings":
        {"fetchNews": "false", "checkForUpdates": False, "doNotDisturbMode": True},
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings":
        {"windowingMode": "none"},
}


class Deadline:
    """A test's time budget, counted from its creation."""

    def __init__(self, budget_s: float):
        self.budget_s, self.start = budget_s, time.monotonic()

    def spent(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.budget_s - self.spent()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kernel_env(base: dict | None = None) -> dict:
    """Environment whose kernels import this checkout's mlxnb (installed or not)."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(REPO)) if p)
    env.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    return env


DARK_THEME = {"@jupyterlab/apputils-extension/themes.jupyterlab-settings":
              {"theme": "JupyterLab Dark"}}


@contextlib.contextmanager
def jupyter_lab(root_dir: Path, work_dir: Path, startup_timeout: float = 60.0,
                app: str = "lab", settings: dict | None = None, args: tuple = ()):
    """Start `jupyter lab` (app="lab") or Notebook 7 (app="notebook") serving
    `root_dir`; yield (base_url, token). `work_dir` holds the server's config/runtime/
    settings/workspaces and its log (server.log); `settings` adds user settings,
    `args` command-line options."""
    work_dir = Path(work_dir)
    dirs = {k: work_dir / k for k in ("config", "runtime", "workspaces", "settings", "data")}
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    for name, value in {**_SETTINGS, **(settings or {})}.items():
        pkg, _, fname = name.rpartition("/")
        (dirs["settings"] / pkg).mkdir(parents=True, exist_ok=True)
        (dirs["settings"] / pkg / fname).write_text(json.dumps(value))

    token, port = secrets.token_hex(16), free_port()
    env = kernel_env()
    env.update(JUPYTER_CONFIG_DIR=str(dirs["config"]), JUPYTER_RUNTIME_DIR=str(dirs["runtime"]),
               JUPYTERLAB_WORKSPACES_DIR=str(dirs["workspaces"]),
               JUPYTERLAB_SETTINGS_DIR=str(dirs["settings"]),
               JUPYTER_DATA_DIR=str(dirs["data"]), JUPYTER_PLATFORM_DIRS="1")
    # The kernel spec lives in sys.prefix (the venv), which JUPYTER_PATH still covers.
    cmd = [sys.executable, "-m", "jupyterlab" if app == "lab" else "notebook",
           "--no-browser", "--allow-root",
           "--ip=127.0.0.1", f"--port={port}", "--ServerApp.port_retries=0",
           f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root_dir}",
           "--ServerApp.open_browser=False"]
    if app == "lab":
        cmd += ["--LabApp.news_url=None",
                "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
                f"--LabApp.user_settings_dir={dirs['settings']}",
                f"--LabApp.workspaces_dir={dirs['workspaces']}"]
    else:
        cmd += [f"--JupyterNotebookApp.user_settings_dir={dirs['settings']}",
                f"--JupyterNotebookApp.workspaces_dir={dirs['workspaces']}"]
    cmd += list(args)
    log = open(work_dir / "server.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                            cwd=str(root_dir), start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"jupyter {app} exited with {proc.returncode}; see "
                                   f"{work_dir / 'server.log'}")
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"jupyter {app} did not answer within "
                                       f"{startup_timeout:.0f} s; see {work_dir / 'server.log'}")
                time.sleep(0.25)
        yield base, token
    finally:
        _shutdown_kernels(base, token)
        _kill(proc)
        log.close()


def _shutdown_kernels(base: str, token: str) -> None:
    """Ask the server to shut its kernels down (they run in sessions of their own, so
    killing the server's group alone would leave them to notice their parent died)."""
    try:
        with urllib.request.urlopen(f"{base}/api/kernels?token={token}", timeout=3) as r:
            kernels = json.load(r)
        for k in kernels:
            req = urllib.request.Request(f"{base}/api/kernels/{k['id']}?token={token}",
                                         method="DELETE")
            urllib.request.urlopen(req, timeout=10).close()
    except Exception:
        pass


def _kill(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group (server + kernels), SIGKILL what lingers."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=8)
        except subprocess.TimeoutExpired:
            pass
    try:  # kernels are in the same session/group; make sure none survives
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


class Cell:
    """A kernel's cell runner: `run(code)` -> (status, printed text and error lines,
    seconds the cell took)."""

    def __init__(self, kc):
        self.kc = kc

    def run(self, code: str, timeout: float = 60):
        out = []

        def hook(m):
            c = m["content"]
            if m["msg_type"] == "stream":
                out.append(c["text"])
            elif m["msg_type"] == "error":
                out.append(f"{c['ename']}: {c['evalue']}")

        t = time.monotonic()
        reply = self.kc.execute_interactive(code, timeout=timeout, output_hook=hook)
        return reply["content"]["status"], "".join(out), time.monotonic() - t


@contextlib.contextmanager
def python_kernel():
    """A real ipykernel importing this checkout's mlxnb; yields a `Cell`. The kernel is
    shut down on exit, whatever happened."""
    import jupyter_client

    km = jupyter_client.KernelManager(kernel_name="python3")
    km.start_kernel(env=kernel_env())
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=60)
        yield Cell(kc)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
