"""Draft models for speculative decoding: a second model that shares the target's
tokenizer, or the target's own first layers (layer-skip self-speculation).

`draft_model="layers:N"` makes a draft of the target's first N decoder layers with
its final norm and output head: no second model, no extra weights (its modules are
the target's own), a KV cache of its own for those N layers. It needs the usual
mlx-lm layout (decoder layers at `model.model.layers`, the head applied in
`model.__call__`), which llama, qwen, mistral, gemma and most families have.
"""

from __future__ import annotations

import copy
import re
from typing import Tuple

__all__ = ["LAYERS", "build_draft", "layer_skip", "vocab_mismatch"]

LAYERS = re.compile(r"^layers:(\d+)$")


def layer_skip(model, n: int):
    """A model that runs `model`'s first n decoder layers, then its norm and head.
    Its modules are the target's (shared, not copied)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, list) or not layers:
        raise ValueError(f"draft_model 'layers:{n}' needs a model whose decoder layers "
                         f"are model.model.layers (llama-style); this "
                         f"{type(model).__name__} has none: pass a draft model instead")
    if not 1 <= n < len(layers):
        raise ValueError(f"draft_model 'layers:N' takes N from 1 to {len(layers) - 1} for "
                         f"this {len(layers)}-layer model, got {n}")
    draft = copy.copy(model)
    draft.model = copy.copy(inner)
    draft.model.layers = layers[:n]
    return draft


def _vocab(tok) -> dict:
    try:
        return dict(tok.get_vocab())
    except Exception:
        return {}


def vocab_mismatch(draft_tok, tok) -> str:
    """Why `draft_tok` is not the same tokenizer as `tok` ('' when it is)."""
    a, b = _vocab(draft_tok), _vocab(tok)
    if len(a) != len(b):
        return f"its tokenizer has {len(a)} tokens, the model's {len(b)}"
    if a != b:
        diff = sum(1 for t, i in a.items() if b.get(t) != i)
        return f"its tokenizer maps {diff} of {len(a)} tokens to other ids"
    return ""


def build_draft(draft, model, tokenizer, out_dim) -> Tuple[object, str]:
    """(draft model, its name) from what `Engine(draft_model=...)` got: 'layers:N',
    a loaded (model, tokenizer) pair, or a model object (taken to share the
    tokenizer). `out_dim(m)` gives a model's logits width (a probe forward).
    Raises ValueError with one line for a draft that cannot draft for `model`."""
    if isinstance(draft, str):
        m = LAYERS.match(draft.strip())
        if not m:
            raise ValueError(f"draft_model must be a model (a name or path, a loaded "
                             f"model) or 'layers:N', got {draft!r}")
        n = int(m.group(1))
        return layer_skip(model, n), f"layers:{n}"
    if isinstance(draft, (tuple, list)):
        dm, dtok = draft
        why = vocab_mismatch(dtok, tokenizer)
        if why:
            raise ValueError(f"the draft model's vocabulary differs from the model's "
                             f"({why}): a draft must share the model's tokenizer")
    else:
        dm = draft
    name = getattr(dm, "model_type", None) or type(dm).__name__
    a, b = out_dim(dm), out_dim(model)
    if a != b:
        raise ValueError(f"the draft model's vocabulary differs from the model's (it "
                         f"scores {a} tokens, the model {b}): a draft must share the "
                         f"model's tokenizer")
    return dm, name
