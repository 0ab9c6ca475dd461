"""``%mlxnb``'s subcommands that read or stop the kernel's engine: status, stop,
dashboard, wait, unload, and the doors to connect and adapter (magics.py runs
``%mlxnb`` and its load)."""

from __future__ import annotations

from IPython.core.error import UsageError

from . import connecting
from .adaptermagic import adapter_command
from .magicargs import _HELP
from ..core.rows import Row
from ..core.run import Run
from .session import _S, _close, get_engine

__all__ = ["Commands"]


class Commands:
    """A mixin of MLXNBMagics: `%mlxnb SUB` runs `_cmd_SUB(rest)`; `self.shell` and
    `self.cfg` are the magics'; `_engine_for` loads a model for `adapter load`."""

    def _cmd_help(self, rest=""):
        print(_HELP)

    def _cmd_connect(self, rest):
        connecting.command(rest)

    def _cmd_adapter(self, rest=""):
        adapter_command(lambda load: self._engine_for(None, False) if load else get_engine(),
                        rest)

    def _cmd_status(self, rest=""):
        c = connecting.pending()
        if c is not None and not c.fut.done():
            print(f"mlxnb: {c.describe()}")
        else:
            connecting.settle()
        eng = get_engine()
        if eng is None:
            print(f"mlxnb: no model loaded yet; {self.cfg.model!r} loads on the first "
                  "%%generate (or `%mlxnb load [MODEL]`)")
            return None
        done = eng.finished
        print(f"mlxnb: {eng.status()}\n  {eng.submitted} rows submitted ({done['cancelled']} "
              f"cancelled, {done['error']} error), {len(eng.steps)} steps, "
              f"max_batch {eng.max_batch}")
        return None

    def _cmd_stop(self, rest=""):
        eng = get_engine()
        if rest and rest != "all":
            obj = self.shell.user_ns.get(rest)
            if not isinstance(obj, (Run, Row)):  # not any object with a cancel()
                raise UsageError(f"%mlxnb stop: {rest!r} is not a Run or Row variable; "
                                 "use `%mlxnb stop` to stop everything")
            live = [r for r in (obj.rows if isinstance(obj, Run) else [obj]) if not r.done]
            obj.cancel()
        else:
            live = [] if eng is None else [r for r in eng.rows if not r.done]
            if eng is not None:
                eng.cancel_all()
        print(f"mlxnb: stopping {len(live)} row{'s' * (len(live) != 1)}")
        return None

    def _cmd_dashboard(self, rest=""):
        eng = get_engine()
        if eng is None:
            raise UsageError("no model loaded yet: run a %%generate cell or "
                             "`%mlxnb load [MODEL]` first, then `%mlxnb dashboard`")
        from .widget import GenerationWidget

        w = GenerationWidget(eng)
        _S.widgets.add(w)
        return w

    def _cmd_wait(self, rest=""):
        print("mlxnb: a magic cannot block on the kernel's loop; in a cell run "
              "`await mlxnb.wait()` (every row) or `await run` (one cell's rows)")

    def _cmd_unload(self, rest=""):
        c = connecting.pending()
        connecting.abandon()  # a connection under way would install itself later
        if c is not None:
            print(f"mlxnb: stopped connecting to {c.url}")
        eng = get_engine()
        if eng is None and c is not None:
            return None
        if eng is None:
            print("mlxnb: no engine to unload")
            return None
        live = eng.running + eng.queued
        _close(eng)
        print(f"mlxnb: closed the engine ({live} unfinished rows cancelled)")
        return None
