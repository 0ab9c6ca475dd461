"""IPython surface: ``%load_ext mlxnb``, the ``%%generate`` cell magic, ``%mlxnb``.

Loading the extension is cheap: it registers the magics, the ``MLXNB`` configurable
(``%config MLXNB.max_tokens = 128``) and a display hook for `Run`; the engine (the
model and its scheduler) starts lazily on the first ``%%generate`` or ``%mlxnb load``.

The kernel's one engine and the ``%config`` values live in session.py, so unloading
the extension (``%unload_ext mlxnb``) leaves them alone: ``%reload_ext mlxnb`` finds
the same engine and its running rows. The option lines are read with magicargs.py;
``%mlxnb``'s subcommands other than load are commands.py's.

A cell magic cannot block on the loop it runs on, so ``%%generate`` returns a `Run` at
once; wait with ``await run`` or ``await mlxnb.wait()`` in a later cell.
"""

from __future__ import annotations

import keyword
import unicodedata
import sys
import time

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from .. import _aio
from . import cellparse as cp
from . import connecting
from .adaptermagic import adapter_names, expand_adapters
from .cellrequests import constraint_params, speculation
from .commands import Commands
from .._text import one_line
from .magicargs import _LOAD, _NO_ARGS, _int_or_word, _parse, _reserved, _sendable
from ..core.run import Run
from .session import (MLXNB, _S, _close, _same_model, get_engine, refuse_if_busy, shutdown,
                      use, wait)

__all__ = ["MLXNB", "MLXNBMagics", "load_ipython_extension", "unload_ipython_extension",
           "wait", "shutdown", "use", "get_engine"]


def _default(name: str, parse):
    """parse() of a %config default; its error says where the value came from."""
    try:
        return parse()
    except UsageError as e:
        raise UsageError(f"the default %config MLXNB.{name} is not valid: {e}") from None


@magics_class
class MLXNBMagics(Commands, Magics):
    def __init__(self, shell, config: MLXNB):
        super().__init__(shell)
        self.cfg = config

    # -- the engine ------------------------------------------------------------------
    def _settings(self, kv_budget=None, max_batch=None, prefill_chunk=None, kv_bits=None,
                  kv_group_size=None, draft=None) -> dict:
        """Engine keywords for a load: the options given, else the %config defaults."""
        c = self.cfg
        kw = dict(kv_bits=c.kv_bits if kv_bits is None else (
                      None if kv_bits == "none" else kv_bits),
                  kv_group_size=c.kv_group_size if kv_group_size is None else kv_group_size,
                  max_batch=c.max_batch if max_batch is None else max_batch,
                  kv_budget=c.kv_budget if kv_budget is None else kv_budget,
                  prefill_chunk=(c.prefill_chunk if prefill_chunk is None else
                                 None if prefill_chunk == "auto" else prefill_chunk),
                  load_timeout=c.load_timeout, draft_model=draft,
                  # an engine that speculates by default compiles its verification
                  # kernels at load (CUDA); cells still pass their own --speculate
                  speculate=c.speculate if c.speculate != "draft" or draft else None)
        if isinstance(kw["kv_budget"], str) and kw["kv_budget"].strip().isdigit():
            kw["kv_budget"] = int(kw["kv_budget"])
        return kw

    def _load(self, spec, settings=None, quiet=False):
        from ..core.engine import Engine

        kw = settings if settings is not None else self._settings()
        if not quiet:
            print(f"mlxnb: loading model {spec!r} ...", flush=True)
        t0 = time.perf_counter()
        try:
            eng = Engine(spec, loop=_aio.shell_loop(), **kw)
        except ValueError as e:
            raise UsageError(f"%mlxnb load: {one_line(e, 300)}") from None
        except Exception as e:  # hub / file / format errors: all the user's to fix
            raise UsageError(
                f"could not load model {spec!r} ({type(e).__name__}: {one_line(e, 200)}); "
                "give an mlx-lm hub id, a local mlx-lm directory, or 'default'") from None
        _S.engine, _S.model_spec, _S.settings = eng, spec, kw
        if not quiet:
            print(f"mlxnb: loaded {eng.model_name!r} in {time.perf_counter() - t0:.1f} s",
                  flush=True)
        return eng

    def _engine_for(self, model, quiet):
        connecting.settle()
        if model is not None and not model.strip():
            raise UsageError("--model needs a model's name; write e.g. --model "
                             f"{self.cfg.model}, or leave --model out")
        eng = get_engine()
        if eng is None:
            return self._load(model or self.cfg.model, quiet=quiet)
        url = getattr(eng, "url", None)
        if model and not _same_model(eng, model) and url is not None:
            url = connecting.shown(url)
            raise UsageError(
                f"this kernel is connected to {url}, model {eng.model_name!r}; run "
                f"`%mlxnb connect {url} --model {model}` to use another of its models, or "
                f"`%mlxnb load {model}` for a local one")
        if model and not _same_model(eng, model):
            raise UsageError(
                f"this kernel runs {_S.model_spec or eng.model_name!r}; run "
                f"`%mlxnb load {model}` first to switch models (one engine at a time)")
        return eng

    # -- %mlxnb ------------------------------------------------------------------------
    @line_magic
    @_sendable
    def mlxnb(self, line=""):
        """Manage the mlxnb engine. Subcommands: load, connect, adapter, status, stop,
        dashboard, wait, unload (``%mlxnb`` alone lists them)."""
        # split at any whitespace: a tab may follow the subcommand
        sub, rest = ((line or "").split(None, 1) + ["", ""])[:2]
        rest = rest.strip()
        fn = getattr(self, f"_cmd_{sub}", None) if sub else self._cmd_help
        if fn is None:
            raise UsageError(f"%mlxnb: unknown subcommand {sub!r}; use one of load, "
                             "connect, adapter, status, stop, dashboard, wait, unload")
        if rest and sub in _NO_ARGS:  # `%mlxnb unload now` must not ignore "now"
            raise UsageError(f"%mlxnb {sub} takes no arguments; got {rest!r}")
        return fn(rest)

    def _cmd_load(self, rest):
        a = _parse(_LOAD, rest, "%mlxnb load", "run %mlxnb alone for the options")
        mb = cp.parse_values("max_batch", a.max_batch, int, sweep=False)[0]
        pc = _int_or_word("prefill_chunk", a.prefill_chunk, "auto")
        auto = pc == "auto"
        kb = _int_or_word("kv_bits", a.kv_bits, "none")
        kg = cp.parse_values("kv_group_size", a.kv_group_size, int, sweep=False)[0]
        for flag, v in (("--max-batch", mb), ("--prefill-chunk", None if auto else pc)):
            if v is not None and v < 1:
                raise UsageError(f"%mlxnb load: {flag} must be a positive integer; got {v}")
        spec = a.model or self.cfg.model
        settings = self._settings(a.kv_budget, mb, pc, kv_bits=kb, kv_group_size=kg,
                                  draft=a.draft)
        eng = get_engine()
        local = eng is not None and getattr(eng, "url", None) is None  # this process
        had = _S.settings  # None: an Engine built in Python, its settings unknown
        loaded = local and _same_model(eng, spec) and (
            settings == had if had is not None else a.kv_budget is a.max_batch
            is a.prefill_chunk is a.kv_bits is a.kv_group_size is a.draft is None)
        if not loaded:  # refused: nothing changes, a connect under way neither
            refuse_if_busy(eng, f"loading {spec!r}")
        connecting.abandon()  # a local model instead of a connection under way
        if loaded:
            print(f"mlxnb: {spec!r} is already loaded")
            return None
        again = local and had is not None and _same_model(eng, spec)  # (before the load
        # names the new model)
        self._load(spec, settings)  # (a failed load raises, keeping the old engine)
        if again:
            changed = ", ".join(f"{k}={v!r}" for k, v in settings.items() if had.get(k) != v)
            print(f"mlxnb: loaded {spec!r} again for its new settings: {changed}")
        if eng is not None:
            _close(eng)
        return None

    # -- %%generate ----------------------------------------------------------------------
    @magic_arguments("%generate")
    @argument("--max-tokens", nargs="+", action="extend", metavar="N",
              help="Most new tokens per row (comma list to sweep).")
    @argument("--temp", "--temperature", dest="temp", nargs="+", action="extend",
              metavar="T", help="Temperature, 0 = greedy; a comma list sweeps: 0.2,0.7,1.0.")
    @argument("--top-p", nargs="+", action="extend", metavar="P", help="Nucleus top-p.")
    @argument("--top-k", nargs="+", action="extend", metavar="K", help="Top-k (0 = off).")
    @argument("--min-p", nargs="+", action="extend", metavar="P", help="Min-p.")
    @argument("--repetition-penalty", nargs="+", action="extend", metavar="R",
              help="Repetition penalty (> 0; 1 = off).")
    @argument("--seed", nargs="+", action="extend", metavar="S",
              help="Seed; a comma list sweeps: 1,2,3.")
    @argument("-n", "--n", dest="n", default=None, metavar="N",
              help="Samples per prompt (distinct seeds derived from --seed).")
    @argument("--stop", action="append", default=None, metavar="TEXT",
              help='Stop string (repeatable; "\\n" is a newline).')
    @argument("--system", default=None, metavar="TEXT", help="System prompt.")
    @argument("--chat", dest="chat", action="store_const", const=True, default=None,
              help="Apply the model's chat template (default).")
    @argument("--raw", dest="chat", action="store_const", const=False,
              help="Send the prompt text as is (no chat template).")
    @argument("--logprobs", default=None, metavar="K",
              help="Keep the top-K log-probabilities per token (0-20).")
    @argument("--json-schema", default=None, metavar="NAME", help="Constrain output to "
              "this JSON schema (a notebook variable: dict, JSON string, pydantic class).")
    @argument("--regex", default=None, metavar="R", help="Constrain output to match R.")
    @argument("--choice", nargs="+", action="extend", default=None, metavar="A,B",
              help="Constrain output to one of these strings (or a list variable's name).")
    @argument("--grammar", default=None, metavar="NAME",
              help="Constrain output to a Lark or GBNF grammar (a notebook variable).")
    @argument("--speculate", default=None, metavar="MODE",
              help="Speculative decoding: 'lookup' (drafts copied from the prompt and "
              "output, verified in one forward; same tokens), 'draft' (the draft model "
              "of `%%mlxnb load MODEL --draft DRAFT`) or 'off'.")
    @argument("--num-draft", default=None, metavar="K",
              help="Drafts per verification (1-16; 0 = adaptive, the default).")
    @argument("--adapter", nargs="+", action="extend", default=None, metavar="NAMES",
              help="Adapter for every row (%%mlxnb adapter load); a comma list runs "
                   "each prompt under each, in one batch: base,ft1,ft2 (base: none).")
    @argument("--model", default=None, help="Model the cell expects (loads it if no "
              "model is loaded yet).")
    @argument("-o", "--out", dest="out", default=None, metavar="NAME",
              help="Also bind the Run to this notebook variable.")
    @argument("--quiet", dest="quiet", action="store_const", const=True, default=None,
              help="No widget; the cell's value is the Run.")
    @cell_magic
    @_sendable
    def generate(self, line="", cell=""):
        """Submit one row per prompt to the engine and return the `Run` at once.

        Body rule: every non-empty line is one prompt. If any line is exactly ``---``,
        the body is instead split into blocks at the ``---`` lines: each block is one
        multi-line prompt (blank lines inside kept, surrounding whitespace removed).
        ``{name}`` inserts a notebook variable (``{{`` / ``}}`` are literal braces); a
        list or tuple variable expands the prompt into one row per element (cartesian
        product for several; ``{name!s}`` inserts the list itself). Comma lists in
        --temp/--seed/--top-p/... sweep; ``--n K`` samples each prompt K times. The
        whole grid (prompts x sweeps x samples) is checked first, then submitted as
        one batch; it joins rows already running. Wait with ``await run`` or
        ``await mlxnb.wait()`` in a later cell. Defaults: ``%config MLXNB``.
        """
        a = _parse(self.generate.parser, line, "%%generate", "see %%generate? for the options")
        c = self.cfg
        if a.out is not None and not (a.out.isidentifier() and not keyword.iskeyword(a.out)):
            raise UsageError(f"-o {a.out!r} is not a valid variable name; write e.g. -o run")
        if a.out is not None and unicodedata.normalize("NFKC", a.out) != a.out:
            plain = unicodedata.normalize("NFKC", a.out)  # what Python reads when typed
            raise UsageError(f"-o {a.out!r}: typed in a cell, Python reads this name as "
                             f"{plain!r}; write -o {plain}")
        if a.out is not None and _reserved(self.shell, a.out):
            raise UsageError(f"-o {a.out!r} would replace a name Python or IPython relies "
                             "on; choose another name, e.g. -o run")
        defaults = {"max_tokens": c.max_tokens, "temp": c.temperature, "top_p": c.top_p,
                    "top_k": c.top_k, "min_p": c.min_p,
                    "repetition_penalty": c.repetition_penalty, "seed": c.seed}
        sweeps = {}
        for opt, (kw, kind, _col) in cp.SWEEPABLE.items():
            raw = getattr(a, opt)
            sweeps[opt] = (cp.parse_values(opt, raw, kind) if raw is not None else
                           _default(kw, lambda: cp.parse_values(opt, defaults[opt], kind)))
        n = cp.parse_values("n", a.n if a.n is not None else 1, int, sweep=False)[0]
        lp = (cp.parse_values("logprobs", a.logprobs, int, sweep=False)[0]
              if a.logprobs is not None else _default("logprobs", lambda: cp.parse_values(
                  "logprobs", c.logprobs, int, sweep=False)[0]))
        stop = [cp.unescape(s) for s in (a.stop if a.stop is not None else c.stop)]
        if any(not s for s in stop):
            msg = "--stop needs a non-empty string; write e.g. --stop '\\n\\n'"
            raise UsageError(msg if a.stop is not None else
                             f"the default %config MLXNB.stop is not valid: {msg}")
        system = cp.unescape(a.system) if a.system is not None else c.system
        chat = c.chat if a.chat is None else a.chat
        quiet = c.quiet if a.quiet is None else a.quiet
        grid = cp.build_grid(cp.split_body(cell), self.shell.user_ns, sweeps, n,
                             limit=c.max_rows)
        if n > 1 and not any(sweeps["temp"]):
            print(f"mlxnb: --n {n} of greedy rows (temperature 0) gives the same text {n} "
                  "times; add e.g. --temp 0.7 for different samples", file=sys.stderr)
        adapters = adapter_names(a.adapter)
        grid = expand_adapters(grid, adapters)
        if c.max_rows is not None and len(grid) > c.max_rows:
            raise cp._too_many(len(grid), c.max_rows)

        common = dict(stop=tuple(stop), logprobs=lp, **speculation(
            a.speculate, a.num_draft, c.speculate, c.num_draft), **constraint_params(
            a.json_schema, a.regex, a.choice, a.grammar, self.shell.user_ns))
        eng = self._engine_for(a.model, quiet)
        _speculation_for(eng, a, common)
        prepared = []  # validate and tokenize EVERY row before submitting any
        for i, g in enumerate(grid):
            try:
                prepared.append(eng.prepare(g.prompt, chat=chat, system=system,
                                            **g.params, **common))
            except ValueError as e:
                where = f"row {i + 1} {one_line(g.prompt, 30)!r}" if len(grid) > 1 else "%%generate"
                raise UsageError(f"{where}: {one_line(e, 300)}") from None
        rows = []
        try:  # an interrupt before the cell returns its Run stops what it submitted
            for g, (ids, sp) in zip(grid, prepared):
                rows.append(eng.submit_prepared(g.prompt, ids, sp, g.tag))
            return self._run_of(eng, rows, a, line, chat, system, adapters, quiet)
        except BaseException:
            if rows:
                eng.cancel(rows)
            raise

    def _run_of(self, eng, rows, a, line, chat, system, adapters, quiet):
        run = Run(rows, name=a.out, meta={"model": eng.model_name, "options": line.strip(),
                                          "chat": chat, "system": system})
        if adapters:
            served = getattr(eng, "adapters", None) or {}  # a server: by name
            run.meta["adapters"] = {n: getattr(served.get(n), "path", n)
                                    for n in adapters if n is not None}
        if not quiet:
            try:
                from .widget import GenerationWidget

                run.widget = GenerationWidget(eng, rows, title=a.out or "")
                _S.widgets.add(run.widget)
            except Exception as e:  # no widget: the run's text repr is the output
                print(f"mlxnb: no live widget ({one_line(e, 120)})", file=sys.stderr)
        if a.out:
            self.shell.user_ns[a.out] = run
        return run


# -- the extension -------------------------------------------------------------------------
def _speculation_for(eng, a, common: dict) -> None:
    """Refuse speculation options that would do nothing on `eng`; a server drafts as it
    was started, so %config's defaults are not sent to one."""
    if getattr(eng, "url", None) is not None:
        if a.speculate is not None or a.num_draft is not None:
            raise UsageError("--speculate and --num-draft draft tokens on a model in this "
                             "process; a server speculates as it was started (use "
                             "`%mlxnb load` for mlxnb's own)")
        common.pop("speculate", None)
        common.pop("num_draft", None)
    elif a.num_draft is not None and common.get("speculate", eng.speculate) is None:
        raise UsageError(f"--num-draft {a.num_draft} sets how many tokens speculative "
                         "decoding drafts, and it is off here; add --speculate lookup "
                         "(or draft), or leave --num-draft out")


def _run_display(run):
    """Display a `Run` as its widget and the widget's results output (widget.py);
    a run without a widget as its repr."""
    w = getattr(run, "widget", None)
    if w is not None:
        w._ipython_display_()
    else:
        from IPython.display import display

        display({"text/plain": repr(run)}, raw=True)


def load_ipython_extension(ip):
    """``%load_ext mlxnb``: register the magics and ``%config MLXNB``; loads no model."""
    cfg = _S.config if (_S.config is not None and _S.shell is ip) else MLXNB(parent=ip)
    _S.config, _S.shell = cfg, ip
    ip.configurables[:] = [x for x in ip.configurables if type(x).__name__ != "MLXNB"]
    ip.configurables.append(cfg)
    ip.register_magics(MLXNBMagics(ip, cfg))
    ip.display_formatter.ipython_display_formatter.for_type(Run, _run_display)


def unload_ipython_extension(ip):
    """``%unload_ext mlxnb``: unregister the magics; the engine and its rows keep
    running (``%mlxnb unload`` first to free it), so a reload reuses them."""
    mm = ip.magics_manager
    mm.magics["line"].pop("mlxnb", None)
    mm.magics["cell"].pop("generate", None)
    mm.registry.pop("MLXNBMagics", None)
    ip.configurables[:] = [x for x in ip.configurables if type(x).__name__ != "MLXNB"]
    ip.display_formatter.ipython_display_formatter.pop(Run, None)
