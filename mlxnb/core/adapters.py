"""Named LoRA/DoRA adapters over an Engine's one base model (the loop side).

    eng.load_adapter("ft1", "adapters/ft1")    # an mlx-lm adapter directory
    eng.submit(prompt, adapter="ft1")          # per row; None or "base": no adapter
    eng.adapters                               # {name: AdapterInfo}
    eng.unload_adapter("ft1")                  # refused while unfinished rows use it

The files are read on a thread of their own (a slow disk never stalls the worker);
the worker then fits them to the model's linears between ticks (worker/adapters.py),
so rows already running keep going and later steps see the new adapter. Their
stacked bytes come out of the KV budget once per engine, not per row.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Dict, Optional

from .. import _aio
from .._text import fmt_bytes, one_line
from .states import Finish
from . import _threads

__all__ = ["AdapterInfo", "Adapters"]


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    path: str
    kind: str  # "lora" | "dora"
    rank: int
    scale: float
    layers: int  # linears it adapts
    nbytes: int  # its weights as read


def _read_on_thread(path, timeout: Optional[float]):
    """models.adapters.read_adapter(path) on a thread of its own, bounded in time."""
    fut: concurrent.futures.Future = concurrent.futures.Future()

    def work():
        _threads._WORKER_TIDS.add(threading.get_native_id())  # it runs MLX
        try:
            from ..models.adapters import read_adapter

            fut.set_result(read_adapter(path))
        except BaseException as e:
            fut.set_exception(e)

    threading.Thread(target=work, daemon=True, name="mlxnb-adapter").start()
    try:
        return fut.result(timeout)
    except concurrent.futures.TimeoutError:
        raise ValueError(f"reading the adapter at {str(path)!r} took longer than "
                         f"{timeout:g} s; check the file system") from None


class Adapters:
    """Engine's adapter methods (a mixin: it uses the Engine's worker, executor,
    rows and scheduler)."""

    _adapters: Dict[str, AdapterInfo]
    _adapter_bytes: int = 0
    _adapter_update: str = ""  # the worker's AdapterSet.update_path (status)

    @property
    def adapters(self) -> Dict[str, AdapterInfo]:
        """The adapters loaded, by name, in load order."""
        return dict(self._adapters)

    @property
    def adapter_bytes(self) -> int:
        """Bytes the loaded adapters' weights take on the device (once per engine)."""
        return self._adapter_bytes

    def load_adapter(self, name: str, path) -> AdapterInfo:
        """Serve the mlx-lm adapter directory `path` (LoRA or DoRA, as `mlx_lm.lora`
        writes it) as `name`. Rows ask for it with `submit(..., adapter=name)`.
        ValueError (one line) for anything that cannot be served."""
        from ..models.adapters import check_adapter_name

        self._check_open()
        check_adapter_name(name)
        if name in self._adapters:
            raise ValueError(f"an adapter named {name!r} is already loaded (from "
                             f"{self._adapters[name].path}); unload it first or pick "
                             "another name")
        files = _read_on_thread(path, _threads.LOAD_TIMEOUT_S)
        if self.kv_budget is not None:
            # a quick refusal on the file's bytes; the stacks (a fused group's B rows
            # span its whole output, DoRA adds per-slot magnitudes) come out of the
            # budget once built
            if self._adapter_bytes + files.nbytes >= self.kv_budget:
                raise ValueError(
                    f"adapters would take {fmt_bytes(self._adapter_bytes + files.nbytes)}"
                    f" of the kv_budget of {fmt_bytes(self.kv_budget)}; raise kv_budget")
        ex = self._exec
        if ex is None:
            self._check_open()
        nbytes = self._on_worker(ex.adapters.add, name, files)
        if self.kv_budget is not None and nbytes >= self.kv_budget:
            # built, the stacks outgrew the file's bytes and would leave no KV room
            self._on_worker(ex.remove_adapter, name)
            raise ValueError(f"adapters would take {fmt_bytes(nbytes)} of the kv_budget "
                             f"of {fmt_bytes(self.kv_budget)} once stacked; raise kv_budget")
        running = (self.scheduler.projected_peak(list(self.scheduler.active.values()))
                   if self.kv_budget is not None else 0)
        if running and nbytes + running > self.kv_budget:
            # the room is the running rows' already: they would pass the budget
            self._on_worker(ex.remove_adapter, name)
            raise ValueError(f"adapters ({fmt_bytes(nbytes)}) and the running rows' KV "
                             f"(up to {fmt_bytes(running)}) would pass the kv_budget of "
                             f"{fmt_bytes(self.kv_budget)}; load it when fewer rows run, "
                             "or raise kv_budget")
        self._adapter_update = self._on_worker(lambda: ex.adapters.update_path)
        info = AdapterInfo(name, files.path, files.kind, files.rank, files.scale,
                           len(files.layers), files.nbytes)
        self._adapters[name] = info
        self._set_adapter_bytes(nbytes)
        return info

    def unload_adapter(self, name: str) -> None:
        """Stop serving `name`; refused while unfinished rows use it (await them or
        cancel them first), so no row changes adapter midway."""
        self._check_open()
        if name not in self._adapters:
            raise ValueError(f"no adapter named {name!r} is loaded{self._loaded_names()}")
        users = sum(1 for r in self._live.values() if r.params.adapter == name)
        if users:
            raise ValueError(f"adapter {name!r} is in use by {users} unfinished row(s); "
                             "await them (cancelled ones too: a cancel takes effect "
                             "on the event loop), then unload it")
        ex = self._exec
        self._on_worker(ex.remove_adapter, name)
        del self._adapters[name]
        self._set_adapter_bytes(self._on_worker(lambda: ex.adapters.nbytes))

    def _set_adapter_bytes(self, nbytes: int) -> None:
        self._adapter_bytes = nbytes
        if self.kv_budget is None:
            return
        self.scheduler.kv_budget = max(self.kv_budget - nbytes, 0)
        if self.loop is not None:  # (rows and their futures belong to the loop)
            try:
                _aio.call_soon(self.loop, self._end_unfit)
            except _aio.NoLoopError:  # no loop runs: nothing is served to end
                pass

    def _end_unfit(self) -> None:
        """A queued row that fitted the budget before may not fit what adapters leave:
        it would wait for ever (or run over it alone); it ends now, saying why. (A row
        held for its constraint is checked as it is released.)"""
        for row in list(self.scheduler.queue):
            why = self.unfit(row)
            if why and self.scheduler.dequeue(row):
                self._end(row, Finish.ERROR, why)

    def unfit(self, row) -> Optional[str]:
        """Why `row` can never fit the KV budget as it stands, or None."""
        why = self.scheduler.never_fits(len(row.prompt_ids), row.params.max_tokens)
        return why and (f"{why} (adapters take {fmt_bytes(self._adapter_bytes)} of it)"
                        if self._adapter_bytes else why)

    def _loaded_names(self) -> str:
        """' (loaded: a, b)', or '' when none is."""
        return f" (loaded: {', '.join(self._adapters)})" if self._adapters else ""

    def _check_adapter(self, adapter: Optional[str]) -> None:
        if adapter is not None and adapter not in self._adapters:
            raise ValueError(f"no adapter named {one_line(repr(adapter), 60)} is loaded"
                             f"{self._loaded_names()}; load it with "
                             "load_adapter(name, path) or %mlxnb adapter load NAME PATH")

    def adapter_status(self) -> str:
        """'ft1 (lora r8, 1.2 MB, 3 rows), ...' or '' when none is loaded."""
        if not self._adapters:
            return ""
        rows = Counter(r.params.adapter for r in self._live.values())
        parts = [f"{n} ({a.kind} r{a.rank}, {fmt_bytes(a.nbytes)}, {rows.get(n, 0)} rows)"
                 for n, a in self._adapters.items()]
        return (f"adapters {', '.join(parts)}; {fmt_bytes(self._adapter_bytes)} on "
                f"device, base rows {rows.get(None, 0)}"
                + (f"; update {self._adapter_update}" if self._adapter_update else ""))
