"""Reading a magic's option line: the ``%mlxnb`` subcommands' parsers and help, and the
checks every magic shares (quotes, repeated options, names a run may bind to, error
messages ipykernel can send). The cell body and option values are cellparse.py's."""

from __future__ import annotations

import argparse
import ast
import functools
import shlex

from IPython.core.error import UsageError
from IPython.core.magic_arguments import MagicArgumentParser

from . import cellparse as cp


def _split(line: str) -> list:
    try:
        return shlex.split(_keep_backslashes(_quoted_choices(line or "")))
    except ValueError as e:
        raise UsageError(f"could not read the options ({e}); close your quotes") from None


def _quoted_choices(line: str) -> str:
    """``--choice {labels}``: IPython writes the list's repr into the line, whose
    quotes the split would drop (``['New York', 'Paris, France']`` would read as three
    options); a list or tuple literal written there (outside quotes) goes on as one
    quoted token holding its repr instead. One pass over the line."""
    out, at, i, quote, n = [], 0, 0, None, len(line)
    while i < n:
        ch = line[i]
        if quote is not None:
            if ch == "\\" and quote == '"':
                i += 1
            elif ch == quote:
                quote = None
            i += 1
            continue
        if ch == "\\":  # (escapes the next character, as the split reads it)
            i += 2
            continue
        if ch in "'\"":
            quote = ch
        elif line.startswith("--choice", i) and (i == 0 or line[i - 1].isspace()):
            j = i + 8
            while j < n and (line[j].isspace() or (line[j] == "=" and j == i + 8)):
                j += 1
            if j < n and line[j] in "[(":
                end = _literal_end(line, j)
                if end is None:  # nothing after it closes: no literal further on either
                    break
                try:
                    v = ast.literal_eval(line[j:end])
                except (ValueError, SyntaxError, MemoryError, RecursionError):
                    v = None
                if isinstance(v, (list, tuple)):
                    out.append(line[at:j])
                    out.append(shlex.quote(repr(list(v))))
                    at = end
                i = end  # (each part of the line is scanned once)
                continue
        i += 1
    return "".join(out) + line[at:]


def _literal_end(line: str, j: int):
    """The end of the bracketed Python literal starting at line[j] ('[' or '('),
    string literals in it skipped; None where it does not close."""
    depth, quote, i = 0, None, j
    while i < len(line):
        ch = line[i]
        if quote is not None:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch in "[(":
            depth += 1
        elif ch in "])":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def _keep_backslashes(line: str) -> str:
    r"""A backslash outside quotes stays in the value (``--regex \d+``, ``--stop \n``)
    unless it escapes a space, a quote or a backslash: a shell would drop it, and a
    regex or stop string would change without a word."""
    out, quote, i = [], None, 0
    while i < len(line):
        ch, nxt = line[i], line[i + 1:i + 2]
        if quote is None and ch == "\\":
            if nxt and nxt in " \t'\"\\":  # an escape a shell user means
                out.append(ch + nxt)
                i += 2
            else:  # doubled, so the split keeps one
                out.append("\\\\")
                i += 1
            continue
        if quote is None and ch in "'\"":
            quote = ch
        elif ch == quote:
            quote = None
        elif quote == '"' and ch == "\\" and nxt:  # \" inside double quotes
            out.append(ch + nxt)
            i += 2
            continue
        out.append(ch)
        i += 1
    return "".join(out)


class _Uses(argparse.Namespace):
    """Counts each option's uses so `_parse` can refuse a repeat: argparse keeps only
    the last of a repeated option (`--n 2 --n 3`, `--raw --chat`, `-o a -o b`), and
    the extend actions would make `--temp 0.2 --temp 0.7` a sweep. Defaults are
    preset, so every later set is a use on the command line."""

    def __init__(self, parser):
        super().__init__()
        d = self.__dict__
        d["_preset"], d["_uses"] = {}, {}
        for a in parser._actions:
            if a.dest != argparse.SUPPRESS and a.dest not in d:
                d[a.dest] = d["_preset"][a.dest] = a.default

    def __setattr__(self, name, value):
        if name not in self._preset or value is not self._preset[name]:
            self._uses[name] = self._uses.get(name, 0) + 1
        super().__setattr__(name, value)


_REPEATABLE = {"stop"}  # --stop A --stop B: documented as repeatable


def _parse(parser, line: str, what: str, hint: str):
    ns = _Uses(parser)
    try:
        a = parser.parse_args(_split(line), namespace=ns)
    except UsageError as e:
        msg = " ".join(str(e).split())
        raise UsageError(f"{what}: {msg}; {hint}") from None
    for dest, n in ns._uses.items():
        acts = [x for x in parser._actions if x.dest == dest and x.option_strings]
        if n > 1 and acts and dest not in _REPEATABLE:
            flags = "/".join(dict.fromkeys(o for x in acts for o in x.option_strings))
            sweep = cp.SWEEPABLE.get(dest)
            how = (f"; to sweep, give one comma list, e.g. --{dest.replace('_', '-')} "
                   f"{'1,2' if sweep[1] is int else '0.2,0.7'}" if sweep else "")
            raise UsageError(f"{what}: {flags} given more than once; give it once{how}")
    return a


def _sendable(magic):
    """A UsageError echoing user text (an option, a {field}, a model name) may hold
    lone surrogates (chr(0xd800)); ipykernel then fails to serialize the error and the
    cell gets no execute_reply at all (it looks hung). So they are escaped (as \\ud800)
    and the message kept on one line."""

    @functools.wraps(magic)
    def wrapper(*args, **kwargs):
        try:
            return magic(*args, **kwargs)
        except UsageError as e:
            msg = " ".join(str(e).split())
            safe = msg.encode("utf-8", "backslashreplace").decode("utf-8")
            if safe == str(e):
                raise
            raise UsageError(safe) from None

    return wrapper


def _reserved(shell, name: str) -> bool:
    """Names a run must not be bound to: builtins (exit, print, ...), dunders
    (__builtins__), and what IPython keeps in the namespace for itself (In, Out,
    get_ipython, _oh, _ih, _dh, _, _i, _5, _i5, ...)."""
    import builtins
    import re

    hidden = getattr(shell, "user_ns_hidden", {}) or {}
    return (hasattr(builtins, name) or name in hidden
            or (name.startswith("__") and name.endswith("__"))
            or re.fullmatch(r"_+|_i+|_i?\d+|_[oid]h", name) is not None)


def _int_or_word(opt: str, raw, word: str):
    """An integer option that also takes one word (`--prefill-chunk auto`)."""
    if (raw or "").strip().lower() == word:
        return word
    try:
        return cp.parse_values(opt, raw, int, sweep=False)[0]
    except UsageError as e:
        raise UsageError(f"{e} (or --{opt.replace('_', '-')} {word})") from None


_LOAD = MagicArgumentParser(prog="%mlxnb load", add_help=False)
_LOAD.add_argument("model", nargs="?", default=None)
_LOAD.add_argument("--kv-budget", default=None)
_LOAD.add_argument("--max-batch", default=None)
_LOAD.add_argument("--prefill-chunk", default=None)
_LOAD.add_argument("--kv-bits", default=None)
_LOAD.add_argument("--kv-group-size", default=None)
_LOAD.add_argument("--draft", default=None)

_CONNECT = MagicArgumentParser(prog="%mlxnb connect", add_help=False)
_CONNECT.add_argument("url")
_CONNECT.add_argument("--model", default=None)
_CONNECT.add_argument("--api-key-env", default=None)
_CONNECT.add_argument("--max-concurrency", default=None)
_CONNECT.add_argument("--timeout", default=None)

_HELP = """%mlxnb subcommands:
  %mlxnb load [MODEL] [--kv-budget 2GB|none] [--max-batch N] [--prefill-chunk N|auto]
               [--kv-bits 4|8|none] [--kv-group-size 64] [--draft MODEL|layers:N]
  %mlxnb connect URL [--model NAME] [--api-key-env VAR] [--max-concurrency N]
               [--timeout S]  an OpenAI-compatible server (vLLM, mlx_lm.server ...);
                           S: longest wait for a row's next tokens (default 60)
  %mlxnb adapter load NAME PATH | list | unload NAME
                           LoRA/DoRA adapters (mlx_lm.lora's directories) for
                           %%generate --adapter base,NAME,...
  %mlxnb status            model, rows running / queued / done, KV memory, adapters
  %mlxnb stop [all|NAME]   cancel every unfinished row (or one Run/Row variable)
  %mlxnb dashboard         a live widget of every row of every cell
  %mlxnb wait              how to wait (await mlxnb.wait() in a cell)
  %mlxnb unload            close the engine and free the model"""
_NO_ARGS = ("status", "dashboard", "wait", "unload", "help")
