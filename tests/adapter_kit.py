"""Adapters for tests: random-weight ones written as mlx-lm writes them, real ones
trained with mlx_lm.lora on the tiny model, and mlx-lm's own generation with an
adapter loaded into a separate copy of the model (the reference rows must match)."""

from __future__ import annotations

import json
import types
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxnb.models.tiny import byte_tokenizer, tiny_model


def base_model(quantized: bool = False):
    """A fresh copy of the tiny model (same weights every call); 4-bit if asked."""
    model, tok = tiny_model()
    if quantized:
        nn.quantize(model, group_size=32, bits=4)
        mx.eval(model.parameters())
    return model, tok


def random_adapter(path, kind="lora", rank=4, scale=2.0, seed=1, keys=None,
                   num_layers=2) -> Path:
    """An adapter directory as mlx_lm.lora writes it, with random weights (so it
    changes the output, unlike a freshly initialised one whose lora_b is zero)."""
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model, _ = base_model()
    params = {"rank": rank, "scale": scale, "dropout": 0.0}
    if keys:
        params["keys"] = keys
    model.freeze()
    linear_to_lora_layers(model, num_layers, params, use_dora=(kind == "dora"))
    flat = tree_flatten(model.trainable_parameters())
    rngs = mx.random.split(mx.random.key(seed), len(flat))
    out = {}
    for (name, p), k in zip(flat, rngs):
        noise = mx.random.normal(p.shape, key=k)
        if name.endswith(".m"):  # DoRA magnitudes: near the base norms
            out[name] = p * (1 + 0.3 * noise)
        else:
            out[name] = 0.5 * noise * p.shape[0] ** -0.5
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "adapters.safetensors"), out)
    (path / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": kind, "num_layers": num_layers, "lora_parameters": params}))
    return path


TRAIN_LINES = [f"Q: what is {a} plus {b}? A: {a + b}." for a in range(6) for b in range(6)]


def write_data(path) -> Path:
    """A few dozen lines of training data in mlx_lm.lora's {"text": ...} jsonl."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"text": t}) for t in TRAIN_LINES]
    (path / "train.jsonl").write_text("\n".join(lines[:30]) + "\n")
    (path / "valid.jsonl").write_text("\n".join(lines[30:]) + "\n")
    return path


def train_adapter(model_dir, data_dir, out, kind="lora", iters=12, seed=0) -> Path:
    """Train an adapter with mlx-lm's own LoRA trainer (mlx_lm.lora.run), in seconds
    on the tiny model."""
    from mlx_lm import lora

    args = dict(lora.CONFIG_DEFAULTS, model=str(model_dir), train=True,
                data=str(data_dir), fine_tune_type=kind, iters=iters, batch_size=2,
                num_layers=2, val_batches=1, steps_per_report=1000,
                steps_per_eval=1000, save_every=1000, adapter_path=str(out),
                learning_rate=2e-2, seed=seed, max_seq_length=64,
                lora_parameters={"rank": 4, "dropout": 0.0, "scale": 10.0})
    lora.run(types.SimpleNamespace(**args))
    return Path(out)


def reference_tokens(adapter, prompt: str, n: int, quantized: bool = False):
    """mlx-lm's greedy generation with `adapter` (a directory, or None for the base)
    loaded into a separate copy of the model."""
    from mlx_lm.generate import generate_step
    from mlx_lm.tuner.utils import load_adapters

    model, _ = base_model(quantized)
    if adapter is not None:
        load_adapters(model, str(adapter))
    model.eval()
    ids = byte_tokenizer().encode(prompt)
    out = []
    for tok, _ in generate_step(mx.array(ids), model, max_tokens=n):
        out.append(int(tok))
        if out[-1] == 257:  # <eos>: the engine's row ends there too
            break
    return out
