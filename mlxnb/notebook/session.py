"""The kernel's session: its one engine and the ``%config MLXNB`` defaults.

Both live in the registry ``_S`` here rather than on the magics, so they outlive the
extension: ``%unload_ext mlxnb`` leaves the engine and its running rows alone and
``%reload_ext mlxnb`` picks the same engine (never a second scheduler) and the same
``%config`` values up again. ``%mlxnb unload`` (or ``await mlxnb.notebook.magics.shutdown()``)
frees the engine.

A cell magic cannot block on the loop it runs on, so waiting is ``await mlxnb.wait()``
in a later cell.
"""

from __future__ import annotations

import asyncio
import os
import weakref

from IPython.core.error import UsageError
from traitlets import Bool, Float, Int, List, TraitError, Unicode, Union, validate
from traitlets.config import Configurable

from .. import _aio
from .._log import swallowed
from ..core._threads import LOAD_TIMEOUT_S

__all__ = ["MLXNB", "get_engine", "use", "wait", "shutdown"]


class MLXNB(Configurable):
    """Defaults for ``%%generate`` and the engine: ``%config MLXNB.<name> = value``."""

    model = Unicode("default", help="Model loaded on first use: 'default', an mlx-lm "
                    "hub id or a local mlx-lm directory.").tag(config=True)
    kv_budget = Union([Int(), Unicode()], default_value="2GB", allow_none=True,
                      help="KV-cache byte budget: '2GB', bytes, or None for no limit."
                      ).tag(config=True)
    max_batch = Int(32, min=1, help="Most rows decoded together.").tag(config=True)
    prefill_chunk = Int(None, min=1, allow_none=True,
                        help="Prompt tokens prefilled per step beside running rows; "
                        "None = auto (about 50 ms of prefill per step).").tag(config=True)
    kv_bits = Int(None, allow_none=True,
                  help="Quantize the KV cache to this many bits (2, 3, 4, 5, 6 or 8; "
                  "4 and 8 are the measured ones; None = full precision).").tag(config=True)
    kv_group_size = Int(64, help="Head dims per quantization group of the KV cache "
                        "(32, 64 or 128).").tag(config=True)
    max_tokens = Int(64, min=1, help="Default --max-tokens.").tag(config=True)
    temperature = Float(0.0, min=0.0, help="Default --temp (0 = greedy).").tag(config=True)
    top_p = Float(1.0, min=0.0, max=1.0, help="Default --top-p.").tag(config=True)
    top_k = Int(0, min=0, help="Default --top-k (0 = off).").tag(config=True)
    min_p = Float(0.0, min=0.0, max=1.0, help="Default --min-p.").tag(config=True)
    repetition_penalty = Float(None, allow_none=True,
                               help="Default --repetition-penalty.").tag(config=True)
    seed = Int(None, min=0, max=2 ** 32 - 1, allow_none=True,
               help="Default --seed.").tag(config=True)
    stop = List(Unicode(), help="Default stop strings.").tag(config=True)
    system = Unicode(None, allow_none=True, help="Default --system prompt.").tag(config=True)
    chat = Bool(True, help="Apply the chat template (False = --raw).").tag(config=True)
    logprobs = Int(0, min=0, max=20, help="Default --logprobs K.").tag(config=True)
    quiet = Bool(False, help="Default --quiet (no widget).").tag(config=True)
    speculate = Unicode(None, allow_none=True,
                        help="Default --speculate: 'lookup', 'draft' (needs a draft "
                        "model: %mlxnb load MODEL --draft DRAFT) or None (off)."
                        ).tag(config=True)
    num_draft = Int(0, min=0, max=16, help="Default --num-draft (0 = adaptive)."
                    ).tag(config=True)
    max_rows = Int(1024, min=1, help="Most rows one cell may expand to.").tag(config=True)
    load_timeout = Float(LOAD_TIMEOUT_S, allow_none=True,
                         help="Most seconds reading a model may take (a download "
                         "included); None = no limit.").tag(config=True)

    @validate("speculate")
    def _speculate(self, proposal):
        v = proposal["value"]
        if v in ("off", "none", "None", ""):
            return None
        if v not in (None, "lookup", "draft"):
            raise TraitError(f"speculate must be 'lookup', 'draft' or None (off), got {v!r}")
        return v

    @validate("load_timeout")
    def _positive(self, proposal):
        v = proposal["value"]
        if v is not None and not v > 0:
            raise TraitError(f"load_timeout must be a positive number of seconds or None "
                             f"(no limit), got {v!r}")
        return v


class _Session:
    """Module-level registry: survives %reload_ext (and a reload of this module)."""

    def __init__(self):
        self.engine = None
        self.model_spec = None  # what the user asked for ("default", hub id, dir)
        self.settings = None  # the Engine keywords %mlxnb load used (None: built in Python)
        self.config = None
        self.shell = None
        self.widgets = weakref.WeakSet()  # every widget we showed, for wait()'s sync
        self.closing = set()  # aclose() tasks in flight
        self.connecting = None  # a %mlxnb connect under way (connecting.py)


_S = globals().get("_S") or _Session()


def get_engine():
    """The kernel's engine, or None before the first %%generate / %mlxnb load."""
    eng = _S.engine
    if eng is not None and getattr(eng, "closed", getattr(eng, "_closed", False)):
        _S.engine = eng = None
    return eng


def use(engine, name=None):
    """Make an `Engine` built in Python (e.g. from an in-memory model) the one the
    magics use. The previous engine, if any, is closed."""
    if _S.engine is not None and _S.engine is not engine:
        _close(_S.engine)
    _S.engine, _S.model_spec = engine, name or getattr(engine, "model_name", None)
    _S.settings = None
    return engine


def refuse_if_busy(eng, before: str) -> None:
    """UsageError while rows not asked to stop are running or queued. Rows stopping end
    'cancelled' when their engine closes, as they would have at their next step."""
    busy = 0 if eng is None else eng.running + eng.queued - eng.stopping
    if busy > 0:
        raise UsageError(f"{busy} rows are still running or queued; `%mlxnb stop` them "
                         f"(or `await mlxnb.wait()`) before {before}")


def _close(eng):
    if _S.engine is eng:
        _S.engine, _S.model_spec, _S.settings = None, None, None
    loop = eng.loop
    # on the loop: free the caches in the background, rows end 'cancelled'
    if loop is not None and _aio.running_loop() is loop:
        task = loop.create_task(eng.aclose())
        _S.closing.add(task)
        task.add_done_callback(_S.closing.discard)
    else:
        eng.close()


def _norm(spec) -> str:
    s = str(spec).strip().rstrip("/")
    p = os.path.expanduser(s)
    return os.path.abspath(p) if os.path.isdir(p) else s


def _same_model(eng, want: str) -> bool:
    """Whether `want` names the engine's model, as the user asked for it or as it loaded;
    a directory by its absolute path, so `./m/` and `~/m` can name the same model."""
    have = {_norm(x) for x in (_S.model_spec, getattr(eng, "model_name", None)) if x}
    return _norm(want) in have


async def shutdown():
    """Close the kernel's engine (its unfinished rows end 'cancelled') and forget it."""
    eng = _S.engine
    _S.engine, _S.model_spec = None, None
    if eng is not None:
        await eng.aclose()
    if _S.closing:
        await asyncio.gather(*list(_S.closing), return_exceptions=True)


async def wait():
    """Wait until every row of the kernel's engine has finished (``await mlxnb.wait()``),
    then bring every widget the magics showed fully up to date (for saved notebooks).
    Interrupting the awaiting cell leaves the rows running."""
    eng = get_engine()
    if eng is None:
        return None

    async def on_loop():
        while any(not r.done for r in list(eng.rows)):  # rows submitted meanwhile too
            await eng.wait()
        for w in list(_S.widgets):
            try:
                w.sync_now()
            except Exception:
                swallowed("widget sync", w.sync_now)

    if eng.loop is None:  # nothing was ever submitted to it
        return None
    await _aio.awaitable_on(eng.loop, on_loop)  # a subshell's loop hops over
    return None
