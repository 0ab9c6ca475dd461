"""A constraint's first tokens, walked before any row takes it: llguidance finds an
empty language and its per-row limits only as it parses, so constrain.py's compile
walks a fresh matcher a few tokens (`probe`), and for a JSON schema each of its
widest objects on its own too (`probe_parts`), and refuses the constraint with a
one-line reason."""

from __future__ import annotations

from typing import Optional

from .._log import log
from .constraint_grammar import grammar as _grammar, parser_limits, wide_parts
from .constraint_params import _EMPTY, _explain

__all__ = ["probe", "probe_parts"]

_PROBE_TOKENS = 4  # tokens a fresh matcher is walked


def probe(kind: str, m, lltok, eos: set, at: Optional[str] = None) -> None:
    """Walk `m` (a fresh copy; of the part of a schema `at` a JSON pointer) a few
    tokens, each the lowest-numbered one its mask allows other than `eos`: an empty
    language, and llguidance's per-row limits (items in a parser row, items per
    token), show at the first token or the next. Raises ValueError saying which."""
    import llguidance.numpy as lln
    import numpy as np

    V = lltok.vocab_size
    buf = lln.allocate_token_bitmask(1, V)
    for step in range(_PROBE_TOKENS):
        if m.is_stopped():
            return
        lln.fill_next_token_bitmask(m, buf, 0)
        if not m.is_error():
            allowed = np.flatnonzero(
                np.unpackbits(buf.view(np.uint8), bitorder="little")[:V])
            tok = next((int(t) for t in allowed if int(t) not in eos), None)
            if tok is None:  # nothing, or only the end: accepting, or nothing at all
                if step == 0 and not m.is_accepting():
                    raise ValueError(_EMPTY[kind])
                return
            m.consume_token(tok)
        if m.is_error():
            err = m.get_error()
            log.debug("%s failed its first tokens: %s", kind, err)
            if step > 0 and "NoExtensionBias" in err:
                return  # a dead branch the probe walked into; other branches may live
            raise ValueError(_explain(kind, err, at))


def probe_parts(schema: dict, lltok, eos: set) -> None:
    """Probe each of a schema's widest objects as a schema of its own, for the limit
    on alternatives that `probe`'s one path passes by (constraint_grammar
    `wide_parts`). Only that limit refuses the schema: a part may fail on its own
    for reasons its place in the whole schema never meets."""
    import llguidance as llg

    try:
        parts = wide_parts(schema)
    except Exception:  # (only a look for one limit: the whole schema compiled)
        log.debug("finding a schema's widest objects failed", exc_info=True)
        return
    for at, part in parts:
        try:
            m = llg.LLMatcher(lltok, _grammar("json_schema", part), log_level=0,
                              limits=parser_limits())
            probe("json_schema", m, lltok, eos, at)
        except BaseException as e:  # a Rust panic too: the whole schema compiled
            if isinstance(e, ValueError) and "llguidance's limit" in str(e):
                raise
            log.debug("probing %s of a schema on its own failed", at, exc_info=True)
