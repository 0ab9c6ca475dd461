"""Structured rows: a JSON schema, a regex, a list of choices or a grammar per row.

llguidance (Rust; a structured-output backend of vLLM and llama.cpp) compiles each
constraint into a matcher over the model's tokenizer and fills each constrained
row's token bitmask for the next step. Constrained rows and free rows share the
batch; only constrained rows pay for masks.

The decode pipeline launches step N+1 before the host has read step N's tokens, but
a row's mask for step N+1 depends on the token it took at step N. So for a batch
that holds constrained rows, `_launch` builds step N+1's forward pass, reads step
N's tokens (done by then: that step was launched a whole step ago), and hands them
to fill threads, which feed each matcher its token and fill the next masks while
the worker launches the forward's kernels (`mx.async_eval` drops the GIL).
Then the worker masks the logits and samples. Masking sets disallowed logits to
-inf before the shared sampler, so greedy, temperature, top-k/p, min-p and the
per-row seeded noise work unchanged, and a seeded constrained row draws the same
tokens alone or in any batch.

Copies of one compiled matcher share its lexer behind one lock (llguidance's
`deep_copy` is shallow there), so rows with one schema would fill their masks one
at a time whatever the thread count. So each row joins a lane, and each lane has
its own compile of every constraint; a step hands whole lanes to as few fill
threads as finish within the launch.

A row whose grammar is complete (nothing may follow) ends with `stop` at once, as if
it had sampled the end-of-sequence token; one cut by max_tokens ends with `length`.
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Dict, List, Optional, Tuple

from ._trace import lap, pc

KINDS = ("json_schema", "regex", "choices", "grammar")
# Whitespace inside JSON is fixed (", " and ": ", none elsewhere): with flexible
# whitespace a model can spend its whole token budget on spaces and newlines.
_JSON_OPTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_CACHE = 256  # compiled constraints kept per engine
# Fill threads: a mask costs 0.01-0.3 ms of one core, a batch's masks several ms, and
# the worker needs a core of its own to launch the forward meanwhile.
_FILL_THREADS = max(1, min(4, (os.cpu_count() or 1) // 4))


def _short(v: Any, n: int = 60) -> str:
    s = " ".join(repr(v).split())
    return s if len(s) <= n else s[: n - 3] + "..."


# -- the user's values (loop side, before a SamplingParams exists) -----------------
def normalize(params: dict) -> dict:
    """Bring constraint keywords to their stored form, in place: json_schema -> dict
    (from a dict, a JSON string or a pydantic model class), choices -> tuple of str.
    ValueError (one line) for a value of the wrong kind, or for two constraints."""
    given = [k for k in KINDS if params.get(k) is not None]
    if len(given) > 1:
        raise ValueError(f"give at most one of json_schema=, regex=, choices=, grammar= per "
                         f"row; got {', '.join(given)}")
    js = params.get("json_schema")
    if js is not None:
        params["json_schema"] = _schema_dict(js)
    ch = params.get("choices")
    if ch is not None:
        if isinstance(ch, (str, bytes)) or not hasattr(ch, "__iter__"):
            raise ValueError(f"choices takes a list of strings, e.g. choices=['yes', 'no']; "
                             f"got {_short(ch)}")
        params["choices"] = tuple(ch)
    return params


def _schema_dict(js) -> dict:
    if isinstance(js, type) and hasattr(js, "model_json_schema"):  # a pydantic model
        js = js.model_json_schema()
    elif isinstance(js, (str, bytes)):
        try:
            js = json.loads(js)
        except ValueError as e:
            raise ValueError(f"json_schema is a string but not valid JSON ({e}); pass a "
                             "dict, a JSON string or a pydantic model class") from None
    if not isinstance(js, dict):
        raise ValueError(f"json_schema takes a dict, a JSON string or a pydantic model "
                         f"class; got {_short(js)}")
    try:  # a deep, JSON-only copy: later edits to the user's dict change nothing here
        return json.loads(json.dumps(js))
    except (TypeError, ValueError) as e:
        raise ValueError(f"json_schema holds a value JSON cannot represent ({e})") from None


def check_params(p) -> None:
    """Type checks for SamplingParams.check (the grammar itself is compiled by
    `Constraints.compile`, which needs the tokenizer)."""
    given = [k for k in KINDS if getattr(p, k) is not None]
    if len(given) > 1:
        raise ValueError(f"give at most one of json_schema=, regex=, choices=, grammar= per "
                         f"row; got {', '.join(given)}")
    if p.json_schema is not None and not isinstance(p.json_schema, dict):
        raise ValueError(f"json_schema must be a dict here; got {_short(p.json_schema)}")
    for k in ("regex", "grammar"):
        v = getattr(p, k)
        if v is not None and not (isinstance(v, str) and v.strip()):
            raise ValueError(f"{k} must be a non-empty string; got {_short(v)}")
    if p.choices is not None:
        if (not isinstance(p.choices, tuple) or not p.choices
                or not all(isinstance(c, str) and c for c in p.choices)):
            raise ValueError(f"choices must be a non-empty list of non-empty strings; got "
                             f"{_short(p.choices)}")


def kind_of(p) -> Optional[str]:
    """Which constraint a row's params carry ('json_schema', ...), or None."""
    for k in KINDS:
        if getattr(p, k, None) is not None:
            return k
    return None


def _key(p) -> Optional[tuple]:
    k = kind_of(p)
    if k is None:
        return None
    v = getattr(p, k)
    return (k, json.dumps(v, sort_keys=True) if k == "json_schema" else
            json.dumps(v) if k == "choices" else v)


def _one_line(msg: str) -> str:
    """llguidance errors quote the grammar with a caret under the fault; keep the
    words and drop the drawing."""
    keep = [ln.strip() for ln in str(msg).splitlines()
            if ln.strip() and not set(ln.strip()) <= {"^", " "}
            and not ln.lstrip()[:1].isdigit()]
    s = " ".join(" ".join(keep).split())
    # positions like "at 1(8):" point into llguidance's internal grammar, not the user's
    s = re.sub(r"\bat \d+\(\d+\):\s*", "", s).replace(" (in regex)", "")
    return s if len(s) <= 300 else s[:299] + "…"


def _grammar(kind: str, value) -> str:
    import llguidance as llg

    LLM = llg.LLMatcher
    if kind == "json_schema":
        return LLM.grammar_from_json_schema(value, defaults=_JSON_OPTS)
    if kind == "regex":
        return LLM.grammar_from_regex(value)
    if kind == "choices":
        return LLM.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
    # Lark, or GBNF (llama.cpp's format), which llguidance converts to Lark
    return llg.grammar_from("grammar", value)


# -- per engine: compiled constraints, and the batch's masks (worker side) ---------
class Constraints:
    """The engine's constraint compiler and the batch's mask filler.

    `validate` runs on the loop (before submitting), `attach` on the worker (a row
    joining the batch). Compiled matchers are cached per constraint and lane, and
    each row gets a copy, so 500 rows with one schema compile it once per lane.
    """

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._lock = threading.Lock()
        self._llt = None
        # constraint -> (grammar, {lane: compiled matcher}); lane "check" is the loop's
        self._cache: "OrderedDict[tuple, Tuple[str, Dict[Any, Any]]]" = OrderedDict()
        self._next_lane = 0
        self._filler = None  # fill threads: the worker launches the forward meanwhile
        # this launch's masks: (bitmask [rows, words], the fills writing into it)
        self._pending: Optional[Tuple[Any, List[Future]]] = None
        self._advanced = None  # the in-flight step whose tokens the matchers consumed
        self._pos_for = None  # batch rows list -> positions of its constrained rows
        self._pos: List[int] = []
        self._idx = None
        self._lanes: List[list] = []  # per lane: [(row in the bitmask, matcher)]
        self._tasks = _FILL_THREADS  # fill tasks per step: as few as keep up (apply)
        self._shifts = None
        self.tracer = None  # _trace.py: set by BatchExecutor.trace

    def lltokenizer(self):
        """llguidance's view of the tokenizer (built once: ~0.4 s for 49k tokens)."""
        with self._lock:
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
                    self._llt = llguidance.hf.from_tokenizer(hf, eos_token=eos, slices=slices)
                except ValueError as e:
                    raise ValueError(f"constrained rows need a fast (Rust) Hugging Face "
                                     f"tokenizer ({e})") from None
            return self._llt

    def compile(self, p, lane: Any = 0):
        """A fresh matcher for `p`'s constraint (None for a free row), sharing its
        lexer with the lane's other rows. ValueError with one line naming what is
        wrong in the schema / regex / grammar."""
        m = self._template(p, lane)
        return None if m is None else m.deep_copy()

    def attach(self, r) -> None:
        """Give a row joining the batch its matcher and lane (rows take the fill
        threads' lanes in turn)."""
        if kind_of(r.params) is None:
            return
        r.lane, self._next_lane = self._next_lane, (self._next_lane + 1) % _FILL_THREADS
        r.matcher = self.compile(r.params, r.lane)

    def validate(self, p) -> None:
        """Compile `p`'s constraint (cached) or raise a one-line ValueError."""
        self._template(p)

    def check(self, p, text: str) -> Optional[str]:
        """Why `text` does not satisfy `p`'s constraint, or None when it does. A
        fresh matcher reads the text as the tokenizer spells it, so this holds for
        any ending: the grammar's own, max_tokens, or a stop string that cut it."""
        m = self.compile(p, "check")  # its own lexer: no fill thread waits for it
        if m is None:
            return None
        ids = list(self._tokenizer.encode(text, add_special_tokens=False))
        n = m.try_consume_tokens(ids)
        what = {"json_schema": "its schema", "regex": "its regex", "choices": "its choices",
                "grammar": "its grammar"}[kind_of(p)]
        if n < len(ids):
            at = len(self._tokenizer.decode(ids[:n]))
            return f"breaks {what} at character {at}: {_short(text[at:], 24)}"
        if not m.is_accepting():
            return f"incomplete: {what} needs more"
        return None

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
        if hit is None:
            g = self._grammar(key[0], getattr(p, key[0]))
        else:
            g = hit[0]
        m = llg.LLMatcher(self.lltokenizer(), g, log_level=0)
        if m.is_error():
            raise ValueError(f"{key[0]} is invalid: {_one_line(m.get_error())}")
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
            raise ValueError(f"{what} is invalid: {_one_line(e)}") from None
        err = llg.LLMatcher.validate_grammar(g, self.lltokenizer())
        if err:
            raise ValueError(f"{what} is invalid: {_one_line(err)}")
        return g

    # -- the batch (worker thread only) --------------------------------------------
    def _read_tokens(self, inflight, rows: Dict[int, Any]) -> list:
        """[(matcher, token)] of the step in flight's constrained rows, each step once
        (whichever of launch and read comes first); [] when already taken."""
        if inflight is None or inflight is self._advanced:
            return []
        self._advanced = inflight
        ids, tokens, _ = inflight
        pairs = [(i, r.matcher) for i, rid in enumerate(ids)
                 if (r := rows.get(rid)) is not None and r.matcher is not None]
        if not pairs:
            return []
        tr = self.tracer
        t = pc() if tr else 0.0
        toks = tokens.tolist()  # the step in flight: done by now (module docstring)
        if tr:
            lap(tr, "mask.wait", t)
        return [(m, toks[i]) for i, m in pairs]

    def advance(self, inflight, rows: Dict[int, Any]) -> None:
        """Feed the step in flight's tokens to its constrained rows' matchers now."""
        _feed(self._read_tokens(inflight, rows))

    def start(self, inflight, rows: Dict[int, Any], batch_rows: list) -> None:
        """Hand the step in flight's tokens to the fill threads, each of which feeds
        its share of the matchers and fills their next masks; `apply` collects them."""
        tr = self.tracer
        t = pc() if tr else 0.0
        feed = self._read_tokens(inflight, rows)
        if self._pos_for is not batch_rows:
            import mlx.core as mx

            self._pos_for = batch_rows
            self._pos = [i for i, r in enumerate(batch_rows) if r.matcher is not None]
            self._idx = mx.array(self._pos) if self._pos else None
            lanes: Dict[Any, list] = {}
            for k, i in enumerate(self._pos):
                r = batch_rows[i]
                lanes.setdefault(r.lane, []).append((k, r.matcher))
            self._lanes = list(lanes.values())
        if not self._pos:
            _feed(feed)  # rows in flight that have left the batch still finish
        else:
            if self._filler is None:
                self._filler = ThreadPoolExecutor(_FILL_THREADS, "mlxnb-masks")
            token = {id(m): tk for m, tk in feed}
            buf = self.bitmask(len(self._pos))
            n = min(self._tasks, len(self._lanes))  # a task fills whole lanes, in turn
            shares = [[x for lane in self._lanes[j::n] for x in lane] for j in range(n)]
            self._pending = (buf, [
                self._filler.submit(_feed_and_fill,
                                    [(m, token.pop(id(m))) for _, m in share if id(m) in token],
                                    share, buf)
                for share in shares])
            _feed([(m, tk) for m, tk in feed if id(m) in token])  # rows that left the batch
        if tr:
            lap(tr, "mask.start", t)

    def apply(self, logits):
        """The batch's logits [B, V] with the constrained rows' masks applied. The
        forward's kernels are launched first, while the fill threads work."""
        import mlx.core as mx

        tr = self.tracer
        t = t0 = pc()
        mx.async_eval(logits)  # releases the GIL: the fill threads run meanwhile
        launch = pc() - t0
        if tr:
            t = lap(tr, "mask.launch", t)
        pending, self._pending = self._pending, None
        if pending is None:
            return logits
        buf, fills = pending
        busy = sum(f.result() for f in fills)
        # Next step: the fewest fill threads that finish within the launch. Each
        # busy core beside the worker slows its launch (~10-20% on an H200 host),
        # so threads that would only wait cost time.
        self._tasks = max(1, min(_FILL_THREADS, math.ceil(1.25 * busy / max(launch, 1e-4))))
        if tr:
            t = lap(tr, "mask.join", t)
        if self._shifts is None:
            self._shifts = mx.arange(32, dtype=mx.uint32)
        if len(self._pos) == logits.shape[0]:
            return masked(logits, mx.array(buf), self._shifts)
        logits[self._idx] = masked(logits[self._idx], mx.array(buf), self._shifts)
        return logits

    def bitmask(self, rows: int):
        """An all-allowed bitmask [rows, ceil(vocab / 32)] int32 (llguidance's layout)."""
        import llguidance.numpy as lln

        return lln.allocate_token_bitmask(rows, self.lltokenizer().vocab_size)

    def fill(self, matchers: list):
        """The next-token bitmasks of `matchers` [len(matchers), words], one thread."""
        buf = self.bitmask(len(matchers))
        _fill(list(enumerate(matchers)), buf)
        return buf

    def finish(self, r, emit, eos: set, finish: Optional[tuple]) -> Optional[tuple]:
        """After a constrained row's token is read: its finish (reason, error), or None.
        A complete grammar ends the row as its end-of-sequence token would."""
        m = r.matcher
        if m.is_error():
            return ("error", f"constraint failed: {_one_line(m.get_error())}")
        if not m.is_stopped():
            return finish
        if finish is None:
            e = min(eos) if eos else -1
            return emit(e, {e})
        return ("stop", None) if finish == ("length", None) else finish

    def reset(self) -> None:
        """Forget the batch (its rows left or failed); a fill still running is
        waited for, so no matcher is read after its row is gone."""
        pending, self._pending = self._pending, None
        if pending is not None:
            wait(pending[1])
        self._advanced = self._pos_for = self._idx = None
        self._pos, self._lanes = [], []

    def close(self) -> None:
        self.reset()
        if self._filler is not None:
            self._filler.shutdown(wait=True)
            self._filler = None


def _fill(share: list, buf) -> None:
    """Each (row, matcher)'s next-token bitmask into that row of `buf`.

    One matcher at a time: each call drops the GIL while it works, so fill threads
    run in parallel. llguidance's own thread pool (LLExecutor) cost more in
    hand-offs than the masks themselves at these sizes (32 rows mid-output, 2 CPU
    cores: 5 ms against 0.4 ms one by one)."""
    import llguidance.numpy as lln

    for k, m in share:
        lln.fill_next_token_bitmask(m, buf, k)


def _feed_and_fill(feed: list, share: list, buf) -> float:
    """Feed, then fill; returns the seconds it took."""
    t = pc()
    _feed(feed)
    _fill(share, buf)
    return pc() - t


def _feed(pairs: list) -> None:
    for m, tok in pairs:
        if not m.is_stopped():
            m.consume_token(tok)  # a refused token leaves m in its error state


def masked(logits, words, shifts):
    """logits [b, V] with every token whose bit is clear in words [b, W] (int32,
    llguidance's layout: token t is bit t % 32 of word t // 32) set to -inf. Tokens
    past the bitmask (padding rows of a larger embedding) are disallowed."""
    global _masked_compiled
    if _masked_compiled is None:
        import mlx.core as mx

        # One fused pass instead of six over [b, V] (CPU, b=32, V=49152: ~4x faster).
        # Not shapeless: the slice to V fixes b; a new b re-traces (~ms), its kernel
        # is the same.
        _masked_compiled = mx.compile(_masked)
    return _masked_compiled(logits, words, shifts)


_masked_compiled = None


def _masked(logits, words, shifts):
    import mlx.core as mx

    b, V = logits.shape
    bits = (words.astype(mx.uint32)[:, :, None] >> shifts) & 1  # [b, W, 32]
    allowed = bits.reshape(b, -1).astype(mx.bool_)
    n = allowed.shape[1]
    if n >= V:
        allowed = allowed[:, :V]
    else:
        allowed = mx.concatenate([allowed, mx.zeros((b, V - n), dtype=mx.bool_)], axis=1)
    return mx.where(allowed, logits, mx.array(-float("inf"), dtype=logits.dtype))


# -- results (loop side) ------------------------------------------------------------
def parse_json(row) -> Tuple[Any, Optional[str]]:
    """(value, None) when the row's text parses as JSON, else (None, reason)."""
    if not row.done:
        return None, f"the row is still {row.state}; await it first"
    cached = getattr(row, "_parsed_json", None)  # a done row's text no longer changes
    if cached is None:
        cached = row._parsed_json = _parse(row)
    return cached


def _parse(row) -> Tuple[Any, Optional[str]]:
    if row.finish_reason in ("error", "cancelled"):
        return None, f"the row ended with {row.finish_reason}" + (
            f": {row.error}" if row.error else "")
    text = row.text
    try:
        value = json.loads(text)
    except ValueError as e:
        cut = " (cut by max_tokens: raise --max-tokens)" if row.finish_reason == "length" else ""
        return None, f"not valid JSON: {e}{cut}"
    if row.constraint_error is not None:  # JSON, cut by a stop string before the schema was met
        return None, row.constraint_error
    return value, None


def record_fields(row) -> dict:
    """Columns a constrained row adds to `Run.records()`: `constraint`, `valid`
    (its output satisfies the constraint), `json_error` and `json.<field>` per
    top-level field of a JSON object."""
    kind = kind_of(row.params)
    if kind is None:
        return {}
    out = {"constraint": kind, "valid": row.valid}
    if kind == "json_schema":
        value, err = parse_json(row)
        out["json_error"] = err
        if isinstance(value, dict):
            out.update({f"json.{k}": v for k, v in value.items()})
        elif value is not None:
            out["json"] = value
    return out


_SHORT = {"json_schema": "json", "regex": "regex", "choices": "choice", "grammar": "grammar"}


def widget_fields(row) -> dict:
    """A constrained row's fields for the widget: `con` (json | regex | choice |
    grammar) and `parse` ('pending', 'ok' or why its output is not valid)."""
    kind = kind_of(row.params)
    if kind is None:
        return {}
    return {"con": _SHORT[kind], "parse": _status(row, kind)}


def _status(row, kind) -> str:
    if not row.done:
        return "pending"
    if kind == "json_schema":
        return parse_json(row)[1] or "ok"
    if row.finish_reason in ("error", "cancelled"):
        return f"incomplete ({row.finish_reason})"
    return row.constraint_error or "ok"
