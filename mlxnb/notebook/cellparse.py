"""Pure parsing for ``%%generate``: the cell body, ``{name}`` interpolation, sweeps.

Nothing here touches IPython's shell, the engine or MLX; every user mistake raises a
one-line :class:`IPython.core.error.UsageError` that says what to do.

Body rule (also in the magic's docstring):

* By default every non-empty line is one prompt (surrounding whitespace stripped).
* If any line consists only of ``---`` the body is split into BLOCKS at those lines
  instead: each block is one (multi-line) prompt, blank lines inside a block are kept,
  and the block's common indentation and surrounding blank lines/whitespace are
  removed. Empty blocks are skipped.

Interpolation: ``{name}`` (also ``{name.attr}``, ``{name[0]}``, ``{name:>5}``) is
replaced by the notebook variable's value; ``{{`` and ``}}`` are literal braces. A
list/tuple value expands the prompt into one prompt per element (cartesian product
when several different fields are lists); add a conversion (``{name!s}``) to insert
the list itself instead.
"""

from __future__ import annotations

import itertools
import math
import random
import re
import string
import textwrap
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from _string import formatter_field_name_split
from IPython.core.error import UsageError

from .._text import RANGES, one_line
from ..core.run import RECORD_COLUMNS, SAVED_COLUMNS

__all__ = [
    "split_body", "interpolate", "parse_values", "unescape", "derive_seed",
    "GridRow", "build_grid", "SWEEPABLE",
]

_SEP = re.compile(r"^[ \t]*---[ \t]*$")
_FMT = string.Formatter()

# Names a sweep variable must not take: the run's own record and saved columns, and
# the tags a grid row gets.
RESERVED = RECORD_COLUMNS | SAVED_COLUMNS | {
    "temp", "seed", "sample", "prompt_index", "max_tokens", "top_p", "top_k", "min_p",
    "repetition_penalty"}


# -- body ------------------------------------------------------------------------
def split_body(body: Optional[str]) -> List[str]:
    """The cell body as a list of prompt templates (see the module docstring)."""
    lines = (body or "").splitlines()
    if any(_SEP.match(ln) for ln in lines):
        blocks, cur = [], []
        for ln in lines + ["---"]:
            if _SEP.match(ln):
                text = textwrap.dedent("\n".join(cur)).strip()
                if text:
                    blocks.append("\n".join(x.rstrip() for x in text.split("\n")))
                cur = []
            else:
                cur.append(ln)
        out = blocks
    else:
        out = [ln.strip() for ln in lines if ln.strip()]
    if not out:
        raise UsageError(
            "the cell has no prompts: write one prompt per line below %%generate "
            "(or blocks separated by --- lines)")
    return out


# -- interpolation ---------------------------------------------------------------
def _fields(template: str, where: str) -> List[Tuple[str, Optional[str], Optional[str], Optional[str]]]:
    try:
        return list(_FMT.parse(template))
    except ValueError as e:
        raise UsageError(f"{where}: {e}; write {{{{ and }}}} for literal braces") from None


def _shown(field: str) -> str:
    """A field as an error message shows it: in braces, on one line."""
    return "{" + field.encode("unicode_escape").decode("ascii") + "}"


def _lookup(field_name: str, ns: dict, where: str) -> Any:
    shown = _shown(field_name)
    try:
        first, rest = formatter_field_name_split(field_name)
    except ValueError as e:
        raise UsageError(f"{where}: bad field {shown} ({e}); "
                         "write {{ and }} for literal braces") from None
    if isinstance(first, int) or first == "" or not str(first).isidentifier():
        raise UsageError(
            f"{where}: {shown} is not a variable name; name a notebook "
            "variable like {topic}, or write {{ and }} for literal braces")
    if first not in ns:
        raise UsageError(
            f"{where}: {{{first}}} is not defined; define {first} in a cell above, "
            "or write {{ and }} for literal braces")
    try:
        obj = ns[first]
        for is_attr, key in rest:
            obj = getattr(obj, key) if is_attr else obj[key]
        return obj
    except Exception as e:  # user data: any lookup error is a usage error
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UsageError(f"{where}: could not evaluate {shown}: "
                         f"{type(e).__name__}: {msg}") from None


def _render(value: Any, conversion: Optional[str], spec: str, field_name: str, where: str) -> str:
    try:
        if conversion:
            value = _FMT.convert_field(value, conversion)
        return _FMT.format_field(value, spec or "")
    except Exception as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UsageError(f"{where}: could not format {_shown(field_name)}: {msg}") from None


def _plan(template: str, ns: dict, where: str):
    """Parse a template and look up its fields: (parts, values, list sweeps)."""
    parts = _fields(template, where)
    values: Dict[str, Any] = {}
    sweeps: Dict[str, list] = {}
    for _lit, fname, spec, conv in parts:
        if fname is None:
            continue
        if spec and ("{" in spec or "}" in spec):
            raise UsageError(f"{where}: nested braces in {_shown(fname + ':' + spec)} are "
                             "not supported; write {{ and }} for literal braces")
        if fname not in values:
            values[fname] = _lookup(fname, ns, where)
        v = values[fname]
        # each occurrence on its own: {xs} sweeps the list, {xs!s} inserts it whole
        if isinstance(v, (list, tuple)) and not conv and fname not in sweeps:
            if len(v) == 0:
                raise UsageError(f"{where}: {{{fname}}} is an empty list, so there is "
                                 "nothing to generate; give it at least one value")
            sweeps[fname] = list(v)
    return parts, values, sweeps


def _expand(plan, where: str) -> List[Tuple[str, Dict[str, Any]]]:
    parts, values, sweeps = plan
    names = list(sweeps)
    out = []
    for combo in itertools.product(*(sweeps[n] for n in names)):
        chosen = dict(zip(names, combo))
        buf = []
        for lit, fname, spec, conv in parts:
            buf.append(lit)
            if fname is not None:
                v = chosen[fname] if fname in chosen and not conv else values[fname]
                buf.append(_render(v, conv, spec, fname, where))
        text = "".join(buf).strip()
        if not text:
            raise UsageError(f"{where} is empty after filling in variables; "
                             "give the variables non-empty values")
        out.append((text, chosen))
    return out


def _too_many(total: int, limit: int):
    return UsageError(f"this cell expands to {total} rows, more than the limit of "
                      f"{limit}; shrink the sweep or raise %config MLXNB.max_rows")


def interpolate(template: str, ns: dict, where: str = "prompt",
                limit: Optional[int] = None) -> List[Tuple[str, Dict[str, Any]]]:
    """Expand one template against the namespace ``ns``.

    Returns ``[(prompt, swept)]``: one pair per expanded prompt, ``swept`` mapping each
    list-valued field (by its text, e.g. ``"topics"``) to the element used. Raises
    UsageError for undefined names, bad braces, empty lists, more than ``limit`` rows.
    """
    plan = _plan(template, ns, where)
    count = math.prod(len(v) for v in plan[2].values())
    if limit is not None and count > limit:
        raise _too_many(count, limit)
    return _expand(plan, where)


# -- option values ---------------------------------------------------------------
# option -> (submit() keyword, type, record column)
SWEEPABLE = {
    "max_tokens": ("max_tokens", int, "max_tokens"),
    "temp": ("temperature", float, "temp"),
    "top_p": ("top_p", float, "top_p"),
    "top_k": ("top_k", int, "top_k"),
    "min_p": ("min_p", float, "min_p"),
    "repetition_penalty": ("repetition_penalty", float, "repetition_penalty"),
    "seed": ("seed", int, "seed"),
}

_EXAMPLES = {  # option -> an example for its range message (ranges: _text.RANGES)
    "max_tokens": "--max-tokens 64", "temp": "--temp 0.7", "top_p": "--top-p 0.9",
    "top_k": "--top-k 40", "min_p": "--min-p 0.05",
    "repetition_penalty": "--repetition-penalty 1.1", "seed": "--seed 1 or --seed 1,2,3",
    "n": "--n 4", "logprobs": "--logprobs 5",
}


def _flag(opt: str) -> str:
    return "--" + opt.replace("_", "-")


def check_value(opt: str, v: Any) -> Any:
    """Range-check one option value; UsageError naming the option if out of range."""
    ok, what = RANGES["temperature" if opt == "temp" else opt]
    if not ok(v):
        raise UsageError(f"{_flag(opt)} must be {what}, e.g. {_EXAMPLES[opt]}; got {v!r}")
    return v


def parse_values(opt: str, raw: Any, kind: type = float, sweep: bool = True) -> list:
    """Parse an option's value(s): a number, or a comma list (``0.2,0.7``), also
    ``[0.2, 0.7]`` as IPython writes a list variable. Returns a non-empty list."""
    if raw is None:
        return [None]
    if isinstance(raw, (int, float)) and not isinstance(raw, bool):
        items: List[Any] = [raw]
    else:
        # tokens as argparse collected them: "0.2,0.7" | "0.2," "0.7" | "[0.2," "0.7]"
        items = []
        for tok in (raw if isinstance(raw, (list, tuple)) else [raw]):
            t = str(tok).strip().strip("[]()").strip()
            if len(t) > 1:
                t = t.strip(",")  # a token's own leading/trailing comma
            items += [x.strip() for x in t.split(",")]
    if not sweep and len(items) > 1:
        raise UsageError(f"{_flag(opt)} takes one value, not a list; got {raw!r}")
    out = []
    for it in items:
        if isinstance(it, str):
            try:
                v = kind(it)
            except ValueError:
                ex = "an integer" if kind is int else "a number"
                hint = (f", or a comma list like {_flag(opt)} {'1,2,3' if kind is int else '0.2,0.7'}" if sweep else "")
                raise UsageError(f"{_flag(opt)}: {it!r} is not {ex}; write e.g. "
                                 f"{_flag(opt)} {'1' if kind is int else '0.7'}{hint}") from None
        else:
            v = it
        if isinstance(v, float) and not math.isfinite(v):
            raise UsageError(f"{_flag(opt)} must be a finite number; got {it!r}")
        out.append(check_value(opt, v) if opt in _EXAMPLES else v)
    return out


_ESC = re.compile(r"\\(n|t|r|\\)")


def unescape(s: str) -> str:
    r"""Turn the escapes ``\n``, ``\t``, ``\r`` and ``\\`` in an option value into
    the characters (so ``--stop "\n"`` stops at a newline)."""
    return _ESC.sub(lambda m: {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}[m.group(1)], s)


def derive_seed(seed: int, k: int) -> int:
    """Seed of sample ``k`` (``--n``) from base ``seed``: sample 0 uses the seed itself,
    sample k uses ``(seed + k * 2654435761) % 2**32`` -- distinct for small seeds."""
    return seed if k == 0 else (seed + k * 2654435761) % (1 << 32)


# -- the grid --------------------------------------------------------------------
@dataclass
class GridRow:
    prompt: str
    params: Dict[str, Any]  # Engine.submit keywords (sampling ones)
    tag: Dict[str, Any] = field(default_factory=dict)


def build_grid(templates: Sequence[str], ns: dict, sweeps: Dict[str, list], n: int = 1,
               limit: Optional[int] = None, rng: Optional[random.Random] = None) -> List[GridRow]:
    """prompts (templates x list variables) x option sweeps x n samples, in that order.

    ``sweeps`` maps each SWEEPABLE option to its (already range-checked) value list;
    ``[None]`` means "unset" (seed: random seeds for sampled rows, none for greedy).
    The row tags hold ``prompt_index``, ``temp``, ``seed``, ``sample``, each swept
    option with more than one value and each list variable's element.
    """
    rng = rng or random.SystemRandom()
    opts = [o for o in SWEEPABLE if o in sweeps]
    per_prompt = math.prod(len(sweeps[o]) for o in opts) * n  # counted before it is built
    plans, total = [], 0
    for i, t in enumerate(templates):
        where = f"prompt {i + 1} {one_line(t, 30)!r}"
        plan = _plan(t, ns, where)
        plans.append((i, where, plan))
        total += math.prod(len(v) for v in plan[2].values()) * per_prompt
    if limit is not None and total > limit:
        raise _too_many(total, limit)
    combos = list(itertools.product(*(sweeps[o] for o in opts)))
    prompts = [(i, text, swept) for i, where, plan in plans
               for text, swept in _expand(plan, where)]
    used_seeds = {s for s in sweeps.get("seed", []) if s is not None}
    rows = []
    for i, text, swept in prompts:
        for combo in combos:
            base = dict(zip(opts, combo))
            for k in range(n):
                params = {SWEEPABLE[o][0]: v for o, v in base.items()}
                seed = base.get("seed")
                if seed is not None:
                    seed = derive_seed(seed, k)
                elif (params.get("temperature") or 0) > 0:
                    seed = rng.randrange(1 << 31)
                    while seed in used_seeds:
                        seed = rng.randrange(1 << 31)
                    used_seeds.add(seed)
                params["seed"] = seed
                tag = {"prompt_index": i,
                       "temp": params.get("temperature"), "seed": seed, "sample": k}
                for o in opts:
                    if o not in ("temp", "seed") and len(sweeps[o]) > 1:
                        tag[SWEEPABLE[o][2]] = base[o]
                for name, v in swept.items():
                    tag[("var_" + name) if name in RESERVED else name] = v
                rows.append(GridRow(text, params, tag))
    return rows
