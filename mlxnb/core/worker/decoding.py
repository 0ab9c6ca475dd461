"""Per-row decoding on the worker: token counts, text, stop strings.

The worker detokenizes every row as its tokens are read and reports text deltas; the
event loop only appends them (`Engine._apply`). One owner per row's detokenizer: a
streaming detokenizer advanced from two threads duplicates or drops characters.
Stop strings are text-level (they may span tokens) and are never shown, so a tail
that could still become one is held back until it cannot.
"""

from __future__ import annotations

from typing import List, Optional

from ..._text import one_line
from ..messages import Emitted, Ending
from ..states import Finish
from .tokens import ids

HISTORY = 256  # tokens of context kept for logits processors (repetition penalty)


class RowDecoder:
    """Host-side state of one decoding row: counts, text, stop strings."""

    matcher = None  # a constrained row's grammar matcher (constrain.py)
    spec = None  # a speculating row's draft state (speculate.py: a source's RowPolicy)
    lane = 0  # its fill lane (masks.py)

    def __init__(self, a, detok, processors):
        self.id = a.row_id
        self.params = a.params
        self.detok = detok
        self.processors = processors
        self.history = ids(a.ids[-HISTORY:]) if processors else None
        self.launched = 0  # decode steps launched for this row
        self.ntok = 0
        self.text = ""  # detokenized text (rows with stop strings: the stops search it)
        self.shown = 0  # chars of text already reported
        self.hold = max((len(s) for s in a.params.stop if isinstance(s, str)), default=0)

    def accept(self, tok: int, lp: Optional[dict], emitted: List[Emitted], eos: set,
               drafted: bool = False) -> Optional[Ending]:
        """Take one sampled token (`drafted`: an accepted draft), append what it
        shows to `emitted`; returns the row's Ending when it ends here."""
        detok = self.detok
        if tok in eos:
            self.flush(emitted)
            return Ending(Finish.STOP)
        self.ntok += 1
        if self.spec is not None:
            self.spec.extend((tok,))
        final = self.ntok >= self.params.max_tokens
        if lp is not None:
            lp["token"] = tok
        detok.add_token(tok)
        if final:
            detok.finalize()
        seg = detok.last_segment
        if not self.params.stop:  # nothing to search or hold back: pass it on
            emitted.append(Emitted(self.id, tok, seg, lp, drafted))
            return Ending(Finish.LENGTH) if final else None
        self.text += seg
        try:
            hit = self._find_stop()
        except BaseException as e:  # a stop callback's failure ends its row only
            # (a KeyboardInterrupt too: on the worker thread it is the callback's own)
            emitted.append(Emitted(self.id, tok, "", lp, drafted))
            return Ending(Finish.ERROR, one_line(f"stop callback failed: {type(e).__name__}: {e}", 300))
        if hit is not None:
            self.text = self.text[:hit]
            emitted.append(Emitted(self.id, tok, self._visible(True), lp, drafted))
            return Ending(Finish.STOP)
        emitted.append(Emitted(self.id, tok, self._visible(final), lp, drafted))
        return Ending(Finish.LENGTH) if final else None

    def flush(self, emitted: List[Emitted]) -> None:
        """The row ends here (end of sequence, or cancelled): show everything
        decoded so far, the detokenizer's held text and any tail held back for a
        stop string that can no longer complete."""
        self.detok.finalize()
        self.text += self.detok.last_segment
        if self.params.stop:  # the detokenizer's held text may complete a stop string
            try:
                hit = self._find_stop()
            except BaseException:  # the row ends here anyway; nothing to cut
                hit = None
            if hit is not None:
                self.text = self.text[:hit]
        emitted.append(Emitted(self.id, None, self._visible(True)))

    def _find_stop(self) -> Optional[int]:
        start = max(0, self.shown - self.hold)
        best = None
        for s in self.params.stop:
            # a callable stop ends the text where it stands; an earlier stop string
            # still cuts it (stop strings are never shown)
            j = (len(self.text) if s(self.text) else -1) if callable(s) else self.text.find(s, start)
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
