"""A prompt and its keywords, checked before anything is queued (both engines), and
the local engine's tokenization: chat templates run bounded in time, and prompts
too long for any tokenization of the context are refused before tokenizing.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional

from .constraint_params import normalize as normalize_constraint
from .rows import SamplingParams
from ._threads import TemplateTimeout, bounded

PARAM_NAMES = {f.name for f in dataclasses.fields(SamplingParams)}
# Chat templates are code from the model directory (sandboxed Jinja, which bounds
# ranges but not nested loops). A render normally takes milliseconds; past this it
# is stopped and the prompt refused, so running rows stall no longer than this.
TEMPLATE_S = 2.0


class WontFit(ValueError):
    """A valid row that exceeds the context or KV budget; submit() returns it as an
    errored row. A type of its own, not a message match: other bad input naming
    "context" or "KV cache" (submit(context=1)) must still raise. `params`: the
    row's checked SamplingParams, which the ended row records."""

    params = None


def check_text(prompt, system=None) -> None:
    """ValueError (one line) unless the prompt (and system prompt, when given) is
    text a tokenizer or a server can take."""
    for name, text in (("prompt", prompt), ("system prompt", system)):
        if text is None and name != "prompt":
            continue
        if not isinstance(text, str):
            raise ValueError(f"a {name} must be a string, got {type(text).__name__}")
        try:  # tokenizers raise a bare TypeError on lone surrogates
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"the {name} holds invalid unicode (lone surrogates); "
                             "clean the text before submitting") from None
    if not prompt.strip():
        raise ValueError("the prompt is empty; write some text to generate from")


def sampling_params(params: dict) -> SamplingParams:
    """The row's SamplingParams from submit()'s keywords (edited in place), or a
    one-line ValueError naming what is wrong."""
    unknown = set(params) - PARAM_NAMES
    if unknown:
        raise ValueError(f"unknown parameter(s): {', '.join(sorted(unknown))}")
    if params.get("stop") is None:
        params["stop"] = ()
    elif isinstance(params["stop"], str):
        params["stop"] = (params["stop"],)
    try:  # a non-iterable (stop=5) must give the message below, not a bare TypeError
        if not isinstance(params["stop"], tuple):
            params["stop"] = tuple(params["stop"])
        params["logits_processors"] = tuple(params.get("logits_processors") or ())
    except TypeError:
        raise ValueError("stop and logits_processors take a list (stop: strings or "
                         "callables text -> bool)") from None
    if params.get("adapter") == "base":  # a sweep's name for "no adapter"
        params["adapter"] = None
    try:
        return SamplingParams(**normalize_constraint(params)).check()
    except TypeError as e:
        raise ValueError(str(e)) from None


def longest_token(tok) -> int:
    """Most characters one token can stand for (its vocabulary string is at least as
    long as its decoded text: byte-level and SentencePiece pieces map 1:1 or more)."""
    try:
        return max(1, max(map(len, tok.get_vocab())))
    except Exception:
        return 0  # unknown: no character limit


def encode(tok, prompt: str, chat: bool, system: Optional[str],
           context_length: Optional[int], max_chars: Optional[int]) -> List[int]:
    """The prompt's token ids: through the model's chat template when `chat` and it
    has one, else the text as is (a system prompt first)."""
    check_text(prompt, system)
    n = len(prompt) + len(system or "")
    if max_chars and n > max_chars:
        raise WontFit(f"the prompt has {n:,} characters, more than the model's context "
                      f"of {context_length} tokens can hold in any tokenization "
                      f"(at most {max_chars:,}); shorten it")
    if chat and getattr(tok, "chat_template", None):
        msgs = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt}]
        try:
            return list(bounded(lambda: tok.apply_chat_template(
                msgs, add_generation_prompt=True), TEMPLATE_S))
        except TemplateTimeout:
            raise ValueError(f"the model's chat template ran longer than "
                             f"{TEMPLATE_S:g} s on this prompt and was stopped (a "
                             "runaway loop in the template?); send the prompt as is "
                             "with chat=False (%%generate --raw)") from None
        except Exception as e:  # Jinja errors: SecurityError, UndefinedError, ...
            msg = " ".join(str(e).split())[:200] or "no message"
            raise ValueError(f"the model's chat template failed on this prompt "
                             f"({type(e).__name__}: {msg}); send the prompt as is "
                             "with chat=False (%%generate --raw)") from None
    text = f"{system}\n\n{prompt}" if system else prompt
    return list(tok.encode(text))
