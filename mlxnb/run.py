"""`Run`: a handle on a group of rows (one `%%generate` cell, one `Engine.generate`)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import List

from .constrain import record_fields as constraint_fields
from .rows import Row, RowResult, on_loop


class Run:
    """Rows submitted together. `await run` -> list of `RowResult` (in row order).

    `run.rows[i]` are live `Row`s (text, tokens, state, finish_reason, ttft_s, tok_s,
    ...) while generating and after. Awaiting is shielded: interrupting the awaiting
    cell leaves the rows running (stop them with `run.cancel()`).
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
        if not self.rows:
            return self._wait().__await__()
        return on_loop(self.rows[0].engine.loop, self._wait).__await__()

    async def _wait(self) -> List[RowResult]:
        if self.rows:
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
        if self.rows:
            self.rows[0].engine.cancel(self.rows)

    def records(self) -> List[dict]:
        out = []
        for r in self.rows:
            rec = {
                "row": r.id, "prompt": r.prompt, "text": r.text,
                "finish_reason": r.finish_reason, "state": r.state,
                "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
                "tokens": r.ntok, "ttft_s": r.ttft_s, "tok_s": r.tok_s,
                "error": r.error,
            }
            if isinstance(r.tag, dict):
                rec.update(r.tag)
            rec.update(constraint_fields(r))
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
        """Write JSONL: one line per row with its params, token ids and stats."""
        path = Path(path)
        with path.open("w", encoding="utf-8") as f:
            for r, rec in zip(self.rows, self.records()):
                from dataclasses import asdict

                params = {k: v for k, v in asdict(r.params).items() if k != "logits_processors"}
                params["stop"] = [s for s in params["stop"] if isinstance(s, str)]
                rec.update(params=params, token_ids=list(r.tokens), logprobs=r.logprobs,
                           model=self.meta.get("model"))
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        return path

    def __repr__(self):
        states = {}
        for r in self.rows:
            k = r.finish_reason if r.done else r.state
            states[k] = states.get(k, 0) + 1
        s = ", ".join(f"{v} {k}" for k, v in states.items())
        name = f" {self.name!r}" if self.name else ""
        return f"<Run{name}: {len(self.rows)} rows ({s})>"
