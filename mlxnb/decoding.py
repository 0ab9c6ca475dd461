"""Per-row decoding on the worker: token counts, stop strings and the text they need.

Only rows with stop strings are detokenized here (their stops are text-level, across
token boundaries, and must never be shown); other rows' text is decoded on the loop
side when read (`Row.text`).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

HISTORY = 256  # tokens of context kept for logits processors (repetition penalty)


class RowDecoder:
    """Host-side state of one decoding row: counts, text, stop strings."""

    matcher = None  # a constrained row's grammar matcher (constrain.py)

    def __init__(self, a, detok, processors):
        self.id = a.row_id
        self.params = a.params
        self.detok = detok
        self.processors = processors
        self.history = mx.array(a.ids[-HISTORY:]) if processors else None
        self.launched = 0  # decode steps launched for this row
        self.ntok = 0
        self.text = ""  # full detokenized text
        self.shown = 0  # chars of text already reported
        self.hold = max((len(s) for s in a.params.stop if isinstance(s, str)), default=0)

    def accept(self, tok: int, lp: Optional[dict], emitted: list, eos: set
               ) -> Optional[tuple]:
        """Take one sampled token; append (row, token|None, new text, logprob) to
        `emitted`; return (finish_reason, error) when the row ends here."""
        detok = self.detok
        if tok in eos:
            if detok is not None:
                detok.finalize()
                self.text += detok.last_segment
                emitted.append((self.id, None, self._visible(True), None))
            return ("stop", None)
        self.ntok += 1
        final = self.ntok >= self.params.max_tokens
        if lp is not None:
            lp["token"] = tok
        if detok is None:
            emitted.append((self.id, tok, None, lp))
            return ("length", None) if final else None
        detok.add_token(tok)
        if final:
            detok.finalize()
        self.text += detok.last_segment
        try:
            hit = self._find_stop()
        except Exception as e:  # a stop callback's failure ends its row only
            emitted.append((self.id, tok, "", lp))
            return ("error", f"stop callback failed: {type(e).__name__}: {e}")
        if hit is not None:
            self.text = self.text[:hit]
            emitted.append((self.id, tok, self._visible(True), lp))
            return ("stop", None)
        emitted.append((self.id, tok, self._visible(final), lp))
        return ("length", None) if final else None

    def _find_stop(self) -> Optional[int]:
        start = max(0, self.shown - self.hold)
        best = None
        for s in self.params.stop:
            if callable(s):
                if s(self.text):
                    return len(self.text)
                continue
            j = self.text.find(s, start)
            if j >= 0 and (best is None or j < best):
                best = j
        return best

    def _visible(self, final: bool) -> str:
        """The newly showable text; a tail that could still become a stop string
        is held back."""
        end = len(self.text) if final or not self.hold else max(self.shown, len(self.text) - self.hold + 1)
        if end <= self.shown:
            return ""
        out, self.shown = self.text[self.shown:end], end
        return out
