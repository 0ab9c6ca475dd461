"""Structured rows: a JSON schema, a regex, a list of choices or a grammar per row.

llguidance (Rust; a structured-output backend of vLLM and llama.cpp) compiles each
constraint into a matcher over the model's tokenizer. This module is the compiler
(`Constraints`: one compile per constraint and lane, a copy per row, checks before
submitting and of a finished row's text); constraint_params.py holds the keywords'
values and their checks, constraint_probe.py the walk that refuses a constraint at
its first tokens, constraint_results.py what a finished row says (`row.json`,
DataFrame columns, the widget's parse status). The batch's masks, filled each step
while the forward launches, are worker/masks.py's.
"""

from __future__ import annotations

import importlib.util
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, TimeoutError as _Timeout
from typing import Any, Dict, Optional, Tuple

from .._log import log
from .constraint_params import _FIX, _WHAT, _key, _short, kind_of, one_line
from .constraint_grammar import grammar as _grammar, parser_limits
from .constraint_probe import probe, probe_parts
from .constraint_results import _CACHE, cut_short, incomplete, verdict
from .states import Finish


# Bounds on compiling a constraint. It runs on a thread of its own, never on the
# kernel's loop; llguidance's compile time grows faster than the schema (1,000
# optional properties 0.1 s, 3,000 2.4 s, 15,000 10-20 s), and a 100 KB schema is
# already far past what a model writes well.
MAX_CONSTRAINT_CHARS = 128_000
COMPILE_TIMEOUT_S = 5.0
# How long a submit waits for its constraint's verdict before returning: ordinary
# constraints compile well within it, so their errors still raise at the submit; a
# slower one goes on in the background and holds its rows in the queue until ready
# (or ends them with `error` and the one-line reason). One wait per compile, shared
# by every submit of that constraint meanwhile.
SUBMIT_WAIT_S = 0.3


_warming = threading.Lock()
_warmed = False
_jsonschema_ready = threading.Event()


def _warm_jsonschema() -> None:
    """Import jsonschema on a thread of its own, once: it takes 1-2 s (its format
    checkers build a parser at import). A JSON row's verdict waits for it
    (`_compile_checked`), so no row's full check imports it: on the worker that
    import stalled every row of the batch, on the loop every cell."""
    global _warmed
    with _warming:
        if _warmed:
            return
        _warmed = True

    def work():
        try:
            import jsonschema  # noqa: F401
        except Exception:
            log.debug("importing jsonschema failed", exc_info=True)
        finally:
            _jsonschema_ready.set()

    threading.Thread(target=work, daemon=True, name="mlxnb-jsonschema").start()


def _too_slow(what: str) -> str:
    return (f"compiling {what} took longer than {COMPILE_TIMEOUT_S:g} s (the limit); "
            f"simplify it: {_FIX[what]}")


class Compiling(Future):
    """The verdict on one constraint being compiled on a thread of its own: a result
    of None when its rows can run, or a one-line ValueError. `t0`: when its compile
    began, None while llguidance's tokenizer is still being built (once per engine,
    from `queued`)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind, self.t0, self.queued = kind, None, time.monotonic()


# -- per engine: the compiler ---------------------------------------------------------
class _PlainText:
    """The tokenizer as llguidance sees it (its tokens' bytes, which are special),
    encoding text with special tokens split: llguidance tokenizes the text a
    constraint forces with it, and text that spells a special token ("<pad>") must
    come out as the text, which the model can write, not as the special token, which
    the constraint's text then refuses."""

    def __init__(self, spelled, hf):
        n = spelled.vocab_size
        self.tokens = [spelled.decode_bytes([i]) for i in range(n)]
        self.special_token_ids = [i for i in range(n) if spelled.is_special_token(i)]
        self.eos_token_id, self.bos_token_id = spelled.eos_token, None
        self._hf = hf

    def __call__(self, text):
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        return self._hf(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


class Constraints:
    """The engine's constraint compiler.

    `validate` runs on the loop (before submitting); the worker compiles a row's
    matcher as it joins the batch. Compiled matchers are cached per constraint and
    lane, and each row gets a copy, so 500 rows with one schema compile it once per
    lane. Copies of one compile share its lexer behind one lock (llguidance's
    `deep_copy` is shallow there), so rows whose masks fill on different threads
    take different lanes (masks.py).
    """

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._lock = threading.Lock()
        self._llt_lock = threading.Lock()
        self._llt = None
        # constraint -> (grammar, {lane: compiled matcher}); lane "check" is the loop's
        self._cache: "OrderedDict[tuple, Tuple[str, Dict[Any, Any]]]" = OrderedDict()
        self._refused: "OrderedDict[tuple, str]" = OrderedDict()  # constraint -> why
        self._pending: Dict[tuple, Compiling] = {}  # constraints being compiled

    def warm(self) -> None:
        """Build llguidance's view of the tokenizer on a thread of its own, now: it
        holds the GIL for up to ~0.7 s at a time (SmolLM2's 49k tokens), which at
        the first constrained submit would freeze the loop that long."""
        if importlib.util.find_spec("llguidance") is None:
            return

        def work():
            try:
                self.lltokenizer()
            except Exception:  # the first constrained submit says why, in one line
                log.debug("building llguidance's tokenizer failed", exc_info=True)

        threading.Thread(target=work, daemon=True, name="mlxnb-lltokenizer").start()

    def lltokenizer(self):
        """llguidance's view of the tokenizer (built once: ~0.4 s for 49k tokens)."""
        with self._llt_lock:  # not self._lock: a submit must not wait on the build
            if self._llt is None:
                try:
                    import llguidance
                    import llguidance.hf
                except ImportError:
                    raise ValueError("constrained rows need llguidance: "
                                     "pip install llguidance") from None
                tw = self._tokenizer
                hf = getattr(tw, "_tokenizer", tw)
                eos = sorted(getattr(tw, "eos_token_ids", None) or ()) or None
                # JSON slices: masks of JSON rows 3x faster (32 rows, SmolLM2's vocab),
                # and regexes, choices and Lark no slower than with the general ones
                slices = llguidance.LLTokenizer.json_slices()
                try:
                    spelled = llguidance.hf.from_tokenizer(hf, eos_token=eos, slices=[])
                except ValueError as e:
                    raise ValueError(f"constrained rows need a fast (Rust) Hugging Face "
                                     f"tokenizer ({e})") from None
                self._llt = llguidance.LLTokenizer(
                    llguidance.TokenizerWrapper(_PlainText(spelled, hf)), eos_token=eos,
                    slices=slices)
            return self._llt

    def compile(self, p, lane: Any = 0):
        """A fresh matcher for `p`'s constraint (None for a free row), sharing its
        lexer with the other copies of that lane's compile. ValueError with one line naming what is
        wrong in the schema / regex / grammar."""
        m = self._template(p, lane)
        return None if m is None else m.deep_copy()

    def validate(self, p, wait: Optional[float] = None) -> Optional[Compiling]:
        """Compile `p`'s constraint (cached) and walk a copy of it over its first
        tokens, or raise a one-line ValueError: for a constraint that cannot compile,
        is too large or slow to, admits no text, or runs into one of llguidance's
        limits where every row would end in error at its first token.

        The compile runs on a thread of its own, bounded by COMPILE_TIMEOUT_S; the
        caller waits for it at most `wait` seconds from its start (None: until the
        verdict). None when the constraint is ready; the pending `Compiling` when its
        verdict is still to come (an interrupt ends the wait, not the compile)."""
        fut = self.pending(p)
        if fut is None:
            return None
        while not fut.done():
            # the wait starts once the tokenizer is built (within the compile's own
            # bound): a first constrained submit after load gets the same wait for
            # its compile as any other
            t0 = fut.t0
            if t0 is None:
                t0 = min(fut.queued + COMPILE_TIMEOUT_S, time.monotonic())
            left = 0.1 if wait is None else min(0.1, t0 + wait - time.monotonic())
            if left <= 0:
                return fut
            try:  # short waits: a pending interrupt is raised between them
                fut.result(left)
            except _Timeout:
                continue
            except ValueError:
                break
        err = fut.exception()
        if err is not None:
            raise ValueError(str(err)) from None
        return None

    def pending(self, p) -> Optional[Compiling]:
        """The verdict on `p`'s constraint, started now if it is not under way: None
        when it is ready (or `p` has none), else a `Compiling` (maybe done already,
        with its ValueError)."""
        key = _key(p)
        if key is None:
            return None
        with self._lock:
            fut = self._pending.get(key)
            if fut is not None:
                return fut
            why = self._refused.get(key)  # its compile may sit in the cache: refuse first
            hit = self._cache.get(key)
            if why is None and hit is not None and 0 in hit[1]:
                return None
            fut = Compiling(key[0])
            if why is None and len(key[1]) > MAX_CONSTRAINT_CHARS:
                why = (f"{key[0]} is {len(key[1]):,} characters, over the limit of "
                       f"{MAX_CONSTRAINT_CHARS:,}; {_FIX[key[0]]}")
                self._refuse(key, why)
            if why is not None:
                fut.set_exception(ValueError(why))
                return fut
            self._pending[key] = fut
        if key[0] == "json_schema":
            _warm_jsonschema()
        threading.Thread(target=self._compile_checked, args=(key, p, fut), daemon=True,
                         name="mlxnb-constraint").start()
        return fut

    def _compile_checked(self, key, p, fut: Compiling) -> None:
        """On its own thread: compile and probe `p`'s constraint, and settle `fut`.
        llguidance compiles with the GIL released but cannot be stopped, so past the
        bound the verdict is a refusal and the compile is left to finish unread."""
        why = None
        try:
            self.lltokenizer()  # built once (~0.4 s for 49k tokens), outside the bound
            fut.t0 = time.monotonic()
            timer = threading.Timer(COMPILE_TIMEOUT_S, self._settle,
                                    (key, fut, _too_slow(key[0])))
            timer.daemon = True
            timer.start()
            try:
                eos = set(getattr(self._tokenizer, "eos_token_ids", None) or ())
                probe(key[0], self._template(p).deep_copy(), self.lltokenizer(), eos)
                if key[0] == "json_schema":
                    probe_parts(p.json_schema, self.lltokenizer(), eos)
            finally:
                timer.cancel()
            if key[0] == "json_schema":  # its rows' full check needs it (above)
                _jsonschema_ready.wait(COMPILE_TIMEOUT_S)
            # the copy `check` reads finished texts with, compiled here rather than on
            # the loop as a row ends (a large schema takes a fifth of a second)
            self._template(p, "check")
        except ValueError as e:
            why = str(e)
        except BaseException as e:  # a Rust panic is a BaseException
            log.warning("checking a %s constraint failed", key[0], exc_info=True)
            why = (f"{key[0]} could not be checked ({type(e).__name__}; the 'mlxnb' "
                   f"logger has the details); {_FIX[key[0]]}")
        self._settle(key, fut, why)

    def _settle(self, key, fut: Compiling, why: Optional[str]) -> None:
        with self._lock:
            if fut.done():  # the bound ran out first
                return
            if self._pending.get(key) is fut:
                del self._pending[key]
            if why is not None:  # the same verdict next time, without compiling again
                self._refuse(key, why)
        if why is None:
            fut.set_result(None)
        else:
            fut.set_exception(ValueError(why))

    def _refuse(self, key, why: str) -> None:  # (under self._lock)
        self._refused[key] = why
        while len(self._refused) > _CACHE:
            self._refused.popitem(last=False)

    def check(self, p, text: str, reason=None, tokens=None) -> Optional[str]:
        """Why `text` does not satisfy `p`'s constraint, or None when it does. A
        fresh matcher reads the text's bytes, so this holds for any ending (`reason`):
        the grammar's own, max_tokens, or a stop string that cut it. (Spelled by
        llguidance's greedy tokenizer, which has no special tokens: the tokenizer's
        own encode would read text such as "<eos>" as the special token.) A row that
        max_tokens ended is all of its `tokens`, when given: the matcher reads those,
        as the worker's did, bytes of a character cut short included."""
        m = self.compile(p, "check")  # its own lexer: no fill thread waits for it
        if m is None:
            return None
        llt = self.lltokenizer()
        cut = cut_short(text, reason)
        if tokens and reason == Finish.LENGTH:
            ids = list(tokens)
            n = m.try_consume_tokens(ids)
            if n < len(ids):
                at = len(llt.decode_str(ids[:n]))
                return (f"breaks {_WHAT[kind_of(p)]} at character {at}: "
                        f"{_short(text[at:], 24)}")
            return verdict(p, m, text, cut)
        # A character cut short is incomplete output, as the worker's matcher, which
        # read its bytes, says: its U+FFFD is not what the model wrote. (The text
        # alone cannot tell a U+FFFD the model wrote last: read as cut too, the
        # likelier by far, e.g. under a regex such as [^\n]+.)
        ids = llt.greedy_tokenize(text[:-1] if cut else text)
        n = m.try_consume_tokens(ids)
        if n < len(ids):
            at = len(llt.decode_str(ids[:n]))
            return f"breaks {_WHAT[kind_of(p)]} at character {at}: {_short(text[at:], 24)}"
        return incomplete(p, cut=True) if cut else verdict(p, m, text)

    def _template(self, p, lane: Any = 0):
        key = _key(p)
        if key is None:
            return None
        import llguidance as llg

        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                if lane in hit[1]:
                    return hit[1][lane]
        try:
            g = self._grammar(key[0], getattr(p, key[0])) if hit is None else hit[0]
            m = llg.LLMatcher(self.lltokenizer(), g, log_level=0, limits=parser_limits())
        except ValueError:
            raise
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # RecursionError, a Rust panic (BaseException), ...
            log.warning("compiling a %s constraint failed", key[0], exc_info=True)
            raise ValueError(f"{key[0]} could not be compiled ({type(e).__name__}; the "
                             f"'mlxnb' logger has the details); {_FIX[key[0]]}") from None
        if m.is_error():
            raise ValueError(f"{key[0]} is invalid: {one_line(m.get_error())}")
        with self._lock:
            hit = self._cache.setdefault(key, (g, {}))
            m = hit[1].setdefault(lane, m)
            self._cache.move_to_end(key)
            while len(self._cache) > _CACHE:
                self._cache.popitem(last=False)
        return m

    def _grammar(self, what: str, value) -> str:
        import llguidance as llg

        try:
            g = _grammar(what, value)
        except ValueError as e:
            raise ValueError(f"{what} is invalid: {one_line(e)}") from None
        err = llg.LLMatcher.validate_grammar(g, self.lltokenizer(), limits=parser_limits())
        if err:
            raise ValueError(f"{what} is invalid: {one_line(err)}")
        return g

    def bitmask(self, rows: int):
        """An all-allowed bitmask [rows, ceil(vocab / 32)] int32 (llguidance's layout)."""
        import llguidance.numpy as lln

        return lln.allocate_token_bitmask(rows, self.lltokenizer().vocab_size)
