"""Tiny random-weight models for tests: real mlx-lm llama classes that build in
milliseconds, with a byte-level tokenizer (or the real SmolLM2 one).

The model is the stock `mlx_lm.models.llama.Model`, so every code path an engine
exercises on a real checkpoint (KV caches, masks, batching) is the same; only the
weights are random. `save_tiny_model` writes an ordinary mlx-lm directory.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

BYTE_SPECIALS = ("<bos>", "<eos>", "<pad>")  # ids 256, 257, 258; byte b has id b
BYTE_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable-unicode table, so the stock ByteLevel pre-tokenizer
    and decoder (and mlx-lm's BPE streaming detokenizer) work on our vocab."""
    printable = set(range(33, 127)) | set(range(161, 173)) | set(range(174, 256))
    out, extra = [], 0
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


def byte_tokenizer_object():
    """A `tokenizers.Tokenizer`: one token per byte (id == byte value), no merges."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(_byte_chars())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                 use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False)
                            for s in BYTE_SPECIALS])
    return tok


def byte_tokenizer():
    """The byte tokenizer wrapped exactly as `mlx_lm.load` would wrap it."""
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=byte_tokenizer_object(),
                                 bos_token="<bos>", eos_token="<eos>",
                                 pad_token="<pad>", clean_up_tokenization_spaces=False)
    hf.chat_template = BYTE_CHAT_TEMPLATE
    return TokenizerWrapper(hf, BPEStreamingDetokenizer,
                            eos_token_ids=[hf.eos_token_id])


def smollm2_tokenizer():
    """The real SmolLM2 tokenizer, from the converted default model directory."""
    from mlx_lm.utils import load_tokenizer

    from .loading import default_model_path

    return load_tokenizer(default_model_path())


def _model_args(vocab_size, layers, hidden, heads, kv_heads, sliding_window,
                layer_types):
    from mlx_lm.models.llama import ModelArgs

    if sliding_window is not None and layer_types is None:
        layer_types = ["sliding_attention"] * layers
    return ModelArgs(
        model_type="llama", hidden_size=hidden, num_hidden_layers=layers,
        intermediate_size=2 * hidden, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=hidden // heads, rms_norm_eps=1e-5,
        vocab_size=vocab_size, rope_theta=10000.0, max_position_embeddings=4096,
        # Untied: with tied random embeddings each token's own logit dominates and
        # greedy decoding just repeats the last token forever.
        tie_word_embeddings=False, layer_types=layer_types,
        sliding_window=sliding_window,
    )


def _build(args, seed: int, printable_only: bool = False):
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.models.llama import Model

    types = args.layer_types
    all_sliding = types is not None and "full_attention" not in types
    if all_sliding:
        # Stock llama needs one full-attention layer to build its mask from; build
        # with layer 0 "full", then flip it, so every layer has a RotatingKVCache and
        # uses the sliding-window mask. (The full mask is computed but unused.)
        args = dataclasses.replace(args, layer_types=["full_attention"] + types[1:])
    model = Model(args)
    if all_sliding:
        model.model.layers[0].use_sliding = True
        model.model.swa_idx = 0
        model.model.layer_types = model.args.layer_types = list(types)

    # Explicit keys instead of mx.random.seed: building a model must not disturb the
    # caller's global RNG (sampling code may depend on it).
    params = tree_flatten(model.parameters())
    keys = mx.random.split(mx.random.key(seed), len(params))
    new = []
    for (name, p), k in zip(params, keys):
        if name.endswith("norm.weight"):
            new.append((name, mx.ones_like(p)))
        else:  # embeddings ~N(0,1), linears ~N(0, 1/fan_in)
            std = 1.0 if "embed" in name else p.shape[-1] ** -0.5
            w = std * mx.random.normal(p.shape, key=k)
            if name == "lm_head.weight" and printable_only:
                # Zero rows give logit exactly 0, while the max over the ~95 random
                # printable-ASCII logits is > 0: greedy output is readable text and
                # never <eos>/<bos>/<pad> (so generations run to max_tokens).
                keep = mx.zeros((p.shape[0], 1))
                keep[10] = 1
                keep[32:127] = 1
                w = w * keep
            new.append((name, w))
    model.update(tree_unflatten(new))
    model.eval()
    mx.eval(model.parameters())
    return model


def tiny_model(vocab: str = "bytes", seed: int = 0, layers: int = 2, hidden: int = 64,
               heads: int = 4, kv_heads: int = 2, sliding_window: int | None = None,
               layer_types: list[str] | None = None):
    """(model, tokenizer) like `mlx_lm.load` returns, with random weights.

    vocab: "bytes" (259 tokens: 256 bytes + <bos>/<eos>/<pad>; eos id 257; greedy
    output is printable ASCII/newlines and never eos, so a generation always runs to
    max_tokens) or "smollm2" (the real 49152-token tokenizer; converts the default
    model if needed; random outputs, eos possible).
    sliding_window=N makes every layer a sliding-window layer, so `make_cache()`
    returns RotatingKVCache(max_size=N) for each; pass layer_types (a list of
    "sliding_attention"/"full_attention", one per layer) for a hybrid model.
    """
    if vocab == "bytes":
        tok = byte_tokenizer()
    elif vocab == "smollm2":
        tok = smollm2_tokenizer()
    else:
        raise ValueError(f"vocab must be 'bytes' or 'smollm2', not {vocab!r}")
    if layer_types is not None and len(layer_types) != layers:
        raise ValueError("layer_types needs one entry per layer")
    args = _model_args(len(tok._tokenizer), layers, hidden, heads, kv_heads,
                       sliding_window, layer_types)
    return _build(args, seed, printable_only=(vocab == "bytes")), tok


def save_tiny_model(path, vocab: str = "bytes", seed: int = 0, **kwargs) -> Path:
    """Write `tiny_model(vocab, seed, **kwargs)` as a normal mlx-lm model directory
    (config.json, model.safetensors, tokenizer files) and return its path.

    mlx-lm's llama needs at least one full-attention layer to load, so an
    all-sliding model cannot be saved; use layer_types for a hybrid instead.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten

    model, tok = tiny_model(vocab, seed, **kwargs)
    types = model.args.layer_types
    if types and "full_attention" not in types:
        raise ValueError("mlx_lm.load cannot build a llama whose layers are all "
                         "sliding-window; pass layer_types with a 'full_attention' "
                         "layer to save a sliding-window tiny model")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in dataclasses.asdict(model.args).items()
              if v is not None}
    config["eos_token_id"] = tok.eos_token_id
    config["bos_token_id"] = tok.bos_token_id
    (out / "config.json").write_text(json.dumps(config, indent=2))
    mx.save_safetensors(str(out / "model.safetensors"),
                        dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    if vocab == "bytes":
        from .gguf import write_tokenizer

        write_tokenizer(out, byte_tokenizer_object(), "<bos>", "<eos>", None, "<pad>",
                        BYTE_CHAT_TEMPLATE, list(BYTE_SPECIALS))
    else:
        from .loading import default_model_path

        src = default_model_path()
        for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            shutil.copy(src / f, out / f)
    return out
