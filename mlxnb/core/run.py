"""`Run`: a handle on a group of rows (one `%%generate` cell, one `Engine.generate`)."""

from __future__ import annotations

import asyncio
import datetime
import json
import math
import os
import secrets
import stat
from pathlib import Path, PurePath
from typing import List

from .._aio import awaitable_on
from .._text import one_line
from .constraint_results import record_fields as constraint_fields
from .rows import Row, RowResult
from .rowtrace import durations


# What Run.records() writes of its own for every row (constraint columns too, and
# `json.<field>`), and what Run.save() adds: a row's tag, its sweep values, must use
# other names (`%%generate` renames a clashing variable var_<name>).
RECORD_COLUMNS = frozenset({
    "row", "prompt", "text", "finish_reason", "state", "prompt_tokens", "cached_tokens",
    "tokens", "ttft_s", "tok_s", "error", "queue_s", "prefill_s", "decode_s",
    "draft_proposed", "draft_accepted", "adapter", "constraint", "valid",
    "constraint_error", "json_error",
    "json", "reasoning", "tag"})
SAVED_COLUMNS = frozenset({"params", "token_ids", "logprobs", "model", "adapter_path",
                           "chat", "system"})


_ABSENT = object()


def _tag_column(name):
    """A tag's column: its own name, or tag_<name> where the run writes that one."""
    if name in RECORD_COLUMNS or name in SAVED_COLUMNS or (
            isinstance(name, str) and name.startswith("json.")):
        return f"tag_{name}"
    return name


class Run:
    """Rows submitted together. `await run` -> list of `RowResult` (in row order).

    `run.rows[i]` are live `Row`s (text, tokens, state, finish_reason, ttft_s, tok_s,
    ...) while generating and after. Awaiting is shielded: interrupting the awaiting
    cell leaves the rows running (stop them with `run.cancel()`). It holds its rows,
    not their engine: a closed engine's model is freed while its runs are kept.
    """

    def __init__(self, rows: List[Row], name: str | None = None, meta: dict | None = None):
        self.rows = rows
        self.name = name
        self.meta = meta or {}
        self.widget = None  # set by the notebook surface when one is displayed

    def __len__(self):
        return len(self.rows)

    def __iter__(self):
        return iter(self.rows)

    def __getitem__(self, i):
        return self.rows[i]

    def __await__(self):
        if not self.rows or (self.done and self.widget is None):
            # nothing left to wait for: no hop to the engine's loop (a script's later
            # asyncio.run awaits a run its first one finished, that loop closed)
            return self._wait().__await__()
        return awaitable_on(self.rows[0]._future.get_loop(), self._wait).__await__()

    async def _wait(self) -> List[RowResult]:
        if not self.done:
            await asyncio.shield(asyncio.gather(*(r._future for r in self.rows)))
        if self.widget is not None:
            # Saved notebooks keep only trait state: make it complete before the
            # awaiting cell ends (nbclient's store_widget_state saved rows at 0 tokens
            # otherwise).
            self.widget.sync_now()
        return self.results

    @property
    def done(self) -> bool:
        return all(r.done for r in self.rows)

    @property
    def results(self) -> List[RowResult]:
        return [r.result() for r in self.rows]

    @property
    def texts(self) -> List[str]:
        return [r.text for r in self.rows]

    def cancel(self) -> None:
        """Stop every unfinished row of this run (they end with 'cancelled')."""
        live = [r for r in self.rows if not r.done]
        cancel = live[0]._canceller() if live and live[0]._canceller else None
        if cancel is not None:  # one trip to the engine for all of them
            cancel(live)

    def records(self) -> List[dict]:
        out = []
        for r in self.rows:
            rec = {
                "row": r.id, "prompt": r.prompt, "text": r.text,
                "finish_reason": r.finish_reason, "state": r.state,
                "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
                "tokens": r.ntok, "ttft_s": r.ttft_s, "tok_s": r.tok_s,
                "error": r.error, **durations(r),
                "draft_proposed": r.draft_proposed, "draft_accepted": r.draft_accepted,
            }
            if r.reasoning:  # a server's reasoning model
                rec["reasoning"] = r.reasoning
            adapter = getattr(r.params, "adapter", None)
            if adapter is not None or "adapters" in self.meta:
                rec["adapter"] = adapter or "base"
            rec.update(constraint_fields(r))
            if isinstance(r.tag, dict):
                for k, v in r.tag.items():
                    col = _tag_column(k)
                    if col == k or rec.get(k, _ABSENT) != v:  # (the same value: said once)
                        rec[col] = v
            elif r.tag is not None:
                rec["tag"] = r.tag
            out.append(rec)
        return out

    def to_pandas(self):
        """One row per prompt, with sweep values, params and stats as columns."""
        try:
            import pandas as pd
        except ImportError:
            raise ImportError("run.to_pandas() needs pandas: pip install pandas") from None
        return pd.DataFrame(self.records())

    def save(self, path) -> Path:
        """Write JSONL: one line per row with its params, token ids and stats, and
        `chat` and `system` where the run knows how its prompts were templated.

        Atomic: written to a temporary file next to `path`, then renamed over it, so a
        failure leaves an existing file as it was. A symbolic link is written through
        (its target is replaced, the link stays); a character device such as /dev/null
        is written as it is; a FIFO, socket or directory is refused. Strict JSON: NaN and
        infinities are written as null; a stop function as "<callable its_name>". Rows
        still running are written as they stand (their state says so). numpy numbers and arrays, dates and
        paths in sweep values are written as JSON numbers, lists and strings."""
        target = _save_target(path)
        given, path = Path(os.path.expanduser(path)), target
        lines = []
        for r, rec in zip(self.rows, self.records()):
            params = r.params.as_dict()
            params["stop"] = [s if isinstance(s, str) else  # a stop function: its name
                              f"<callable {getattr(s, '__qualname__', type(s).__name__)}>"
                              for s in params["stop"]]
            rec.update(params=params, token_ids=list(r.tokens), logprobs=r.logprobs,
                       model=self.meta.get("model"))
            # how the prompt became tokens, where the run knows it (a re-run needs it)
            rec.update({k: self.meta[k] for k in ("chat", "system") if k in self.meta})
            if params.get("adapter") is not None:
                rec["adapter_path"] = self.meta.get("adapters", {}).get(params["adapter"])
            rec = _str_keys(rec)  # JSON keys are strings (a sweep may key by tuples)
            try:  # strict JSON: other tools (jq, JavaScript) refuse NaN and Infinity
                line = json.dumps(rec, ensure_ascii=False, default=_json_default,
                                  allow_nan=False)
            except ValueError:
                rec = _finite(rec)
                line = json.dumps(rec, ensure_ascii=False, default=_json_default)
            try:
                line.encode("utf-8")
            except UnicodeEncodeError:  # lone surrogates: JSON's \ud800 escapes
                line = json.dumps(rec, ensure_ascii=True, default=_json_default)
            lines.append(line + "\n")
        if path.exists() and not path.is_file():  # a device such as /dev/null: as is
            with open(path, "w", encoding="utf-8") as f:
                f.writelines(lines)
            return given
        # a short name: the file's own may already be at the file system's limit
        tmp = path.with_name(f".mlxnb-save.{secrets.token_hex(4)}.tmp")
        try:
            try:
                f = open(tmp, "x", encoding="utf-8")  # the usual permissions
            except OSError as e:
                raise OSError(e.errno, f"cannot save to {str(given)!r} ({e.strerror}); "
                                       f"save to a file in a folder you can write") from None
            with f:
                f.writelines(lines)
                f.flush()
                os.fsync(f.fileno())
            if path.exists():  # a file replaced keeps its permissions
                try:
                    os.chmod(tmp, stat.S_IMODE(path.stat().st_mode))
                except OSError:  # a file system without modes (vfat, some network mounts)
                    pass
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        return given

    def __repr__(self):
        states = {}
        for r in self.rows:
            k = r.finish_reason if r.done else r.state
            states[k] = states.get(k, 0) + 1
        s = ", ".join(f"{v} {k}" for k, v in states.items())
        name = f" {self.name!r}" if self.name else ""
        return f"<Run{name}: {len(self.rows)} rows ({s})>"


def _str_keys(o):
    """`o` with every dict key JSON cannot write (a tuple, a number type of numpy's)
    as its str()."""
    if isinstance(o, dict):
        return {(k if isinstance(k, (str, int, float, bool)) or k is None else str(k)):
                _str_keys(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_str_keys(v) for v in o]
    return o


def _finite(o):
    """`o` as JSON values, NaN and infinities as null (as pandas writes them)."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    if o is None or isinstance(o, (str, int)):
        return o
    return _finite(_json_default(o))


def _json_default(o):
    """JSON for the values sweeps and tags commonly hold; anything else as its str()."""
    item = getattr(o, "item", None)  # numpy scalars and 0-d arrays
    if callable(item) and getattr(o, "ndim", 0) == 0:
        return item()
    tolist = getattr(o, "tolist", None)  # numpy arrays
    if callable(tolist):
        return tolist()
    if isinstance(o, (datetime.date, datetime.time)):
        return o.isoformat()
    if isinstance(o, (PurePath, os.PathLike)):
        return os.fspath(o)
    if isinstance(o, (set, frozenset, tuple)):
        return list(o)
    if isinstance(o, bytes):
        return o.decode("utf-8", "backslashreplace")
    return str(o)


def _save_target(path) -> Path:
    """The file `Run.save` writes: links resolved; a path it cannot write atomically,
    or that would block (a FIFO with no reader), refused in one line."""
    if not isinstance(path, (str, os.PathLike)) or not str(path).strip():
        raise ValueError(f"run.save needs a file name, e.g. run.save('run.jsonl'); got "
                         f"{one_line(repr(path), 60)}")
    target = Path(os.path.realpath(os.path.expanduser(path)))
    if target.is_dir():
        raise ValueError(f"{str(path)!r} is a directory; give a file name in it, "
                         f"e.g. {str(Path(path) / 'run.jsonl')!r}")
    if target.exists():
        mode = target.stat().st_mode
        if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
            raise ValueError(f"{str(path)!r} is a FIFO or socket; save to a regular file")
    elif not target.parent.is_dir():
        raise ValueError(f"the folder {str(target.parent)!r} does not exist; create it "
                         f"first (os.makedirs) or save elsewhere")
    return target
