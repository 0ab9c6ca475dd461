"""A zoo of tiny random-weight instances of every model family in `mlx_lm.models`.

Each family is built from a small config (`COMMON`, a config.json-like dict that
`ModelArgs.from_dict` filters to the fields the family has, plus that family's entry in
`OVERRIDES`) at float32 with a fixed seed, and checked with one forward pass of a
[1, 5] token batch on `make_prompt_cache(model)`. Hybrid families get layer patterns
with both kinds of layer (attention and linear-attention / SSM / conv), sliding
windows are short (8 tokens) so decoding crosses them, MoE layers have 4 experts.
A family that cannot be built as a tiny text-only model says why in `SKIP`.

    python -m tests.zoo --table     # markdown: family -> cache kinds -> status
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import io
import pkgutil
import sys
from collections import Counter
from typing import Dict, List, Optional

import mlxnb  # noqa: F401  (first: it puts OpenBLAS under MLX on Linux CPU)

VOCAB = 259  # mlxnb.models.tiny's byte tokenizer: 256 bytes + <bos>/<eos>/<pad>
# Rows kept in [vocab, d] matrices: printable ASCII, newline, and id 0 -- the engine
# pads prefill groups with token 0, so its embedding must be a real one (a zero
# vector would hide padding that leaks into a recurrent state)
KEPT_IDS = [0, 10] + list(range(32, 127))

# mlx_lm.models modules that hold shared layers, not a model family
HELPERS = {"activations", "base", "bitlinear_layers", "cache", "gated_delta", "mla",
           "pipeline", "rope_utils", "ssm", "switch_layers"}

# A config.json for a tiny model under every common spelling; each family's
# ModelArgs.from_dict keeps only the keys it declares.
_H, _L, _I, _NH, _KV, _HD = 64, 2, 128, 4, 2, 16
COMMON = dict(
    # sizes
    hidden_size=_H, d_model=_H, n_embd=_H, model_dim=_H, hidden_dim=_H, dim=_H,
    num_hidden_layers=_L, num_layers=_L, n_layer=_L, n_layers=_L,
    num_transformer_layers=_L,
    intermediate_size=_I, ffn_hidden_size=_I, n_inner=_I, ff_intermediate_size=_I,
    intermediate_size_mlp=_I, block_dim=_H, block_ff_dim=_I,
    num_attention_heads=_NH, n_head=_NH, n_heads=_NH, num_heads=_NH,
    num_key_value_heads=_KV, n_kv_heads=_KV, num_kv_heads=_KV,
    num_attention_groups=_KV, head_dim=_HD, kv_channels=_HD, hidden_size_per_head=_HD,
    vocab_size=VOCAB, num_vocab=VOCAB,
    max_position_embeddings=4096, n_positions=4096, n_ctx=4096, block_size=4096,
    model_max_length=4096,
    # norms, rope
    rms_norm_eps=1e-5, layer_norm_eps=1e-5, layer_norm_epsilon=1e-5, norm_eps=1e-5,
    norm_epsilon=1e-5, layernorm_epsilon=1e-5,
    rope_theta=10000.0, rotary_emb_base=10000, partial_rotary_factor=0.5,
    rotary_pct=0.5, rotary_dim=8,
    # Untied: with tied random embeddings greedy decoding repeats the last token.
    tie_word_embeddings=False,
    attention_bias=False, mlp_bias=False, use_bias=False, use_qkv_bias=False,
    use_qk_norm=False, qk_norm=False, bias=False, qkv_bias=False, post_norm=False,
    # MoE: 4 small experts, 2 per token, first layer dense where the family has one
    num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4,
    num_experts_per_tok=2, moe_topk=2, moe_k=2, moe_top_k=2, top_k_experts=2,
    moe_intermediate_size=32, expert_ffn_hidden_size=32, shared_intermediate_size=32,
    shared_expert_intermediate_size=32, moe_shared_expert_intermediate_size=32,
    share_expert_dim=32,
    n_shared_experts=1, num_shared_experts=1, num_shared_expert=1,
    first_k_dense_replace=1, num_dense_layers=1, decoder_sparse_step=1,
    mlp_only_layers=[], norm_topk_prob=True, routed_scaling_factor=1.0,
    n_group=1, topk_group=1,
    # MLA
    kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
    v_head_dim=16,
    # sliding windows short enough that decoding runs past them
    sliding_window=8, sliding_window_size=8, attention_window_size=8, window_size=8,
    # linear attention / SSM / conv
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_conv_kernel_dim=4, conv_kernel=4, conv_L_cache=3,
    conv_bias=False, use_conv_bias=True, state_size=8, ssm_state_size=8,
    mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_n_heads=4, mamba_d_head=16,
    mamba_num_heads=4, mamba_head_dim=16, mamba_n_groups=1, n_groups=1,
    mamba_proj_bias=False, mamba_conv_bias=True, time_step_rank=8,
    time_step_limit=(0.001, 100.0),
)


# Quantized KV groups are >= 32 wide: twice the width, head dims 32 (config_for keys)
KV_WIDE = dict({k: 2 * _H for k in ("hidden_size", "d_model", "n_embd", "model_dim",
                                    "hidden_dim", "dim", "block_dim")},
               head_dim=32, linear_key_head_dim=32, linear_value_head_dim=32)


def _layers(n):  # every spelling of the layer count
    return {k: n for k in ("num_hidden_layers", "num_layers", "n_layer", "n_layers",
                           "num_transformer_layers")}


SW, FA, LA = "sliding_attention", "full_attention", "linear_attention"
# Per family: config keys over COMMON. Hybrids list both kinds of layer.
OVERRIDES: Dict[str, dict] = {
    "afm7": dict(_layers(3), num_kv_reuse_layers=1),
    "afmoe": dict(_layers(3), layer_types=[SW, FA, SW], num_dense_layers=1),
    "baichuan_m1": dict(_layers(3), sliding_window_layers=[0, 2], conv_window=2),
    "bailing_hybrid": dict(_layers(4), layer_group_size=2, group_norm_size=1),
    "bailing_moe_linear": dict(_layers(4), layer_group_size=2, group_norm_size=1,
                               num_attention_heads=4, num_key_value_heads=4),
    "bailing_moe_v3": dict(_layers(4), layer_group_size=2),
    "cohere2": dict(_layers(4), sliding_window_pattern=2),
    "dbrx": dict(ffn_config=dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2),
                 attn_config=dict(kv_n_heads=2, clip_qkv=8, rope_theta=10000.0)),
    "deepseek_v2": dict(topk_method="greedy", rope_scaling=dict(factor=1.0)),
    "gemma3n": dict(_layers(4), layer_types=[SW, FA, SW, FA], num_kv_shared_layers=0,
                    vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8,
                    rope_local_base_freq=10000.0, final_logit_softcapping=30.0,
                    activation_sparsity_pattern=[0.0] * 4, altup_num_inputs=2,
                    altup_coef_clip=120.0, altup_correct_scale=True, altup_active_idx=0,
                    laurel_rank=8),
    "hunyuan": dict(use_mixed_mlp_moe=True, use_cla=False, cla_share_factor=2,
                    rope_scaling=dict(type="dynamic", factor=1.0, alpha=1.0)),
    "mimo_v2_flash": dict(_layers(3), hybrid_layer_pattern=[1, 0, 1],
                          moe_layer_freq=[0, 1, 1], add_swa_attention_sink_bias=True,
                          add_full_attention_sink_bias=False, topk_method="noaux_tc",
                          scoring_func="sigmoid", swa_rope_theta=10000.0,
                          swa_num_attention_heads=4, swa_num_key_value_heads=2,
                          swa_head_dim=16, swa_v_head_dim=16, partial_rotary_factor=1),
    "minicpm3": dict(dim_model_base=64, scale_depth=1.0, scale_emb=1.0,
                     rope_scaling=dict(original_max_position_embeddings=4096)),
    "muse_spark": dict(_layers(3), layer_types=[SW, FA, SW], post_norm_eps=1e-5,
                       rope_parameters=dict(rope_theta=10000.0),
                       layer_rope_theta=[10000.0] * 3, final_logit_softcapping=30.0,
                       output_multiplier=1.0, moe_hidden_size=32, num_shared_experts=0),
    "exaone4": dict(_layers(4), rope_scaling=None, sliding_window_pattern="LLLG"),
    "exaone_moe": dict(_layers(3), layer_types=[SW, FA, SW],
                       is_moe_layer=[False, True, True]),
    "falcon_h1": dict(mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16),
    "gear": dict(_layers(3), layer_types=[SW, FA, SW]),
    "gemma3": dict(_layers(4), sliding_window_pattern=2),
    "gemma3_text": dict(_layers(4), sliding_window_pattern=2),
    "gemma4": dict(_layers(4), sliding_window_pattern=2, num_kv_shared_layers=0,
                   vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8),
    "gemma4_text": dict(_layers(4), sliding_window_pattern=2, num_kv_shared_layers=0,
                        vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8),
    "glm4_moe": dict(rope_scaling=None),
    "glm_moe_dsa": dict(index_head_dim=16, index_n_heads=2, index_topk=4,
                        topk_method="noaux_tc", scoring_func="sigmoid", moe_layer_freq=1,
                        rope_parameters=dict(rope_theta=10000.0, rope_type="default")),
    "granite": dict(logits_scaling=1.0, attention_multiplier=0.25,
                    embedding_multiplier=1.0, residual_multiplier=1.0),
    "granitemoe": dict(logits_scaling=1.0, attention_multiplier=0.25,
                       embedding_multiplier=1.0, residual_multiplier=1.0),
    "granitemoehybrid": dict(_layers(3), logits_scaling=1.0, attention_multiplier=0.25,
                             embedding_multiplier=1.0, residual_multiplier=1.0,
                             layer_types=["mamba", "attention", "mamba"]),
    "jamba": dict(_layers(4), attn_layer_offset=1, attn_layer_period=2,
                  expert_layer_offset=1, expert_layer_period=2),
    "kimi_k3": dict(_layers(4), num_experts_per_token=2, linear_attn_config=dict(
        num_heads=4, head_dim=16, short_conv_kernel_size=4, kda_layers=[1, 3],
        full_attn_layers=[2, 4])),
    "kimi_linear": dict(_layers(4), linear_attn_config=dict(
        num_heads=4, head_dim=16, short_conv_kernel_size=4, kda_layers=[1, 3],
        full_attn_layers=[2, 4])),
    "lfm2": dict(_layers(3), block_multiple_of=16, block_ffn_dim_multiplier=1.0,
                 block_auto_adjust_ff_dim=False, full_attn_idxs=[1]),
    "lfm2-vl": dict(_layers(3), block_multiple_of=16, block_ffn_dim_multiplier=1.0,
                    block_auto_adjust_ff_dim=False, full_attn_idxs=[1]),
    "lfm2_moe": dict(_layers(3), use_expert_bias=True, full_attn_idxs=[1]),
    "llama4": dict(_layers(4), num_experts_per_tok=1, attention_chunk_size=8, interleave_moe_layer_step=2,
                   rope_scaling=None, no_rope_layers=[1, 1, 1, 0]),
    "llama4_text": dict(_layers(4), no_rope_layers=[1, 1, 1, 0]),
    "longcat_flash": dict(attention_method="MLA", zero_expert_type="identity",
                          zero_expert_num=1, mla_scale_q_lora=True,
                          mla_scale_kv_lora=True),
    "longcat_flash_ngram": dict(zero_expert_num=1, mla_scale_q_lora=True,
                                mla_scale_kv_lora=True),
    "mellum": dict(_layers(3), layer_types=[SW, FA, SW], rope_parameters={
        SW: dict(rope_theta=10000.0), FA: dict(rope_theta=10000.0)}),
    "minicpm": dict(dim_model_base=64, scale_depth=1.0, scale_emb=1.0),
    "ministral3": dict(_layers(3), layer_types=[SW, FA, SW], rope_parameters=dict(
        rope_theta=10000.0, rope_type="default", llama_4_scaling_beta=0.1,
        original_max_position_embeddings=4096)),
    "mistral4": dict(rope_parameters=dict(
        rope_theta=10000.0, rope_type="default", llama_4_scaling_beta=0.1,
        original_max_position_embeddings=4096)),
    "nemotron": dict(hidden_act="relu2"),
    "nemotron_h": dict(hybrid_override_pattern=["M", "*", "M", "E"]),
    "nemotron-nas": dict(block_configs=[
        dict(attention=dict(n_heads_in_group=2), ffn=dict(ffn_mult=1.0)),
        dict(attention=dict(no_op=True), ffn=dict(ffn_mult=1.0))]),
    "olmo3": dict(_layers(4)),
    "olmo_hybrid": dict(_layers(4), linear_allow_neg_eigval=True),
    "openelm": dict(ffn_dim_divisor=16, num_query_heads=[4, 4], num_kv_heads=[2, 2],
                    ffn_multipliers=[1.0, 2.0]),
    "phi3small": dict(dense_attention_every_n_layers=2, gegelu_limit=20.0),
    "plamo": dict(n_shared_head=2),
    "plamo2": dict(_layers(4), mamba_step=2),
    "qwen3_5": dict(_layers(4), full_attention_interval=2),
    "qwen3_5_moe": dict(_layers(4), full_attention_interval=2),
    "qwen3_next": dict(_layers(4), full_attention_interval=2),
    "recurrent_gemma": dict(_layers(3), conv1d_width=4, logits_soft_cap=30.0,
                            block_types=["recurrent", "attention"]),
    "rwkv7": dict(a_low_rank_dim=8, v_low_rank_dim=8, gate_low_rank_dim=8,
                  decay_low_rank_dim=8),
    "spark2_5": dict(_layers(4), rope_parameters={
        SW: dict(rope_theta=10000.0), FA: dict(rope_theta=10000.0)}),
}

# Families no tiny text-only instance can stand for here: one line why.
SKIP: Dict[str, str] = {
    "prism_hadamard_qwen35": "a 2-bit Hadamard-rotated weight pack; it loads only from "
                             "such a checkpoint (qwen3_5 covers its layers)",
}
# ... and those that need a backend feature: (test, reason) on the current device.
_METAL_ONLY = "runs a Metal-only kernel (mlx_lm.models' own); this device has no Metal"
NEEDS: Dict[str, tuple] = {
    "bitnet": ("metal", _METAL_ONLY),
    "muse_spark": ("metal", _METAL_ONLY),
    # its block-sparse attention mask corrupts the heap in MLX's CPU backend: the
    # process aborts, at once or later ("corrupted size vs. prev_size")
    "phi3small": ("gpu", "its block-sparse attention corrupts memory on MLX's CPU "
                         "backend (the process aborts)"),
}


def skip_reason(family: str) -> Optional[str]:
    import mlx.core as mx

    if family in SKIP:
        return SKIP[family]
    need, why = NEEDS.get(family, (None, None))
    if need == "metal" and not mx.metal.is_available():
        return why
    if need == "gpu" and mx.default_device() == mx.cpu:
        return why
    return None


@dataclasses.dataclass
class Member:
    family: str
    model: object = None
    cache_kinds: str = ""  # e.g. "2 ArraysCache + 2 KVCache"
    reason: Optional[str] = None  # why it cannot be built (model is None)

    @property
    def ok(self) -> bool:
        return self.model is not None


def families() -> List[str]:
    import mlx_lm.models

    return sorted(m.name for m in pkgutil.iter_modules(mlx_lm.models.__path__)
                  if m.name not in HELPERS)


def config_for(family: str, mod=None, **overrides) -> dict:
    cfg = dict(COMMON, model_type=family)
    cfg.update(OVERRIDES.get(family, {}), **overrides)
    if mod is not None:
        fields = {f.name for f in dataclasses.fields(mod.ModelArgs)}
        if "text_config" in fields and "text_config" not in OVERRIDES.get(family, {}):
            cfg["text_config"] = {k: v for k, v in cfg.items() if k != "text_config"}
    return cfg


def cache_kinds(cache) -> str:
    """'2 ArraysCache + 2 KVCache'; a CacheList shows what it holds."""
    def name(c):
        inner = getattr(c, "caches", None)
        if type(c).__name__ == "CacheList" and inner is not None:
            return f"CacheList({', '.join(name(x) for x in inner)})"
        return type(c).__name__

    counts = Counter(name(c) for c in cache)
    return " + ".join(f"{n} {k}" for k, n in sorted(counts.items()))


def _printable_rows(model):
    """Zero the rows of every [vocab, d] matrix (embedding, output head) outside
    KEPT_IDS: those logits are exactly 0 while the max of ~96 random ones is > 0,
    so greedy output is text (or NUL) and never <eos>; prompts never use those ids,
    so zeroed embedding rows change nothing else."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    keep = mx.zeros((VOCAB, 1))
    keep[mx.array(KEPT_IDS)] = 1
    new = [(k, v * keep.astype(v.dtype)) for k, v in tree_flatten(model.parameters())
           if v.ndim == 2 and v.shape[0] == VOCAB and mx.issubdtype(v.dtype, mx.floating)]
    if new:
        model.update(tree_unflatten(new))


def build(family: str, seed: int = 0, dtype: str = "float32", **overrides) -> Member:
    """A tiny random instance of `family` (config keys in `overrides` win), checked
    with one [1, 5] forward."""
    import mlx.core as mx

    why = skip_reason(family)
    if why:
        return Member(family, reason=why)

    said = io.StringIO()
    try:
        with contextlib.redirect_stdout(said):
            mod = importlib.import_module(f"mlx_lm.models.{family}")
    except SystemExit:  # some modules print what to install and exit
        return Member(family, reason=f"needs an extra package: {said.getvalue().strip()}")
    mx.random.seed(seed)
    args = mod.ModelArgs.from_dict(config_for(family, mod, **overrides))
    model = mod.Model(args)
    model.set_dtype(getattr(mx, dtype))
    _printable_rows(model)
    model.eval()
    mx.eval(model.parameters())
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array([[72, 101, 108, 108, 111]]), cache=cache)
    mx.eval(logits)
    if logits.shape[:2] != (1, 5) or logits.shape[-1] < VOCAB:
        raise RuntimeError(f"{family}: logits of shape {logits.shape}")
    if not mx.isfinite(logits).all().item():
        raise RuntimeError(f"{family}: non-finite logits")
    return Member(family, model, cache_kinds(cache))


def build_all(names=None) -> List[Member]:
    out = []
    for f in names or families():
        try:
            out.append(build(f))
        except Exception as e:
            out.append(Member(f, reason=f"build fails: {type(e).__name__}: {e}"))
    return out


# Four prompts of different lengths (bytes = tokens), the longest past the 8-token
# windows; the fourth joins mid-run and extends the first (a prefix-cache candidate).
PROMPTS = ["Hi there", "a", "The quick brown fox jumps over the lazy dog, twice.",
           "Hi there, and a few more words"]
MAX_TOKENS = 14


@dataclasses.dataclass
class Result:
    family: str
    cache_kinds: str = ""
    status: str = ""  # "batched" | "refused" | "mismatch" | "skipped" | "error"
    detail: str = ""  # refusal / skip / error reason, or the first mismatch
    alone: Optional[list] = None  # tokens per prompt, each on a fresh engine
    batched: Optional[list] = None  # the same prompts in one batch, the last joining
    reference: Optional[list] = None  # mlx_lm's generate_step, prompt 0


def _first_diff(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b)) if len(a) != len(b) else None


def engine(model, **kw):
    """An mlxnb Engine on (model, byte tokenizer) as the zoo runs it."""
    import mlxnb
    from mlxnb.models.tiny import byte_tokenizer

    kw = dict(dict(warmup=False, kv_budget=None, max_batch=8), **kw)
    return mlxnb.Engine((model, byte_tokenizer()), **kw)


async def _alone(eng, prompts, n):
    """Each prompt alone: one row at a time on one engine without a prefix cache (a
    row never sees another's state), which is what a fresh engine per prompt gives."""
    out = []
    for p in prompts:
        row = await eng.submit(p, chat=False, max_tokens=n)
        out.append((row.tokens, row.finish_reason, row.error))
    return out


async def _batched(model, prompts, n, kw):
    """All but the last prompt at once; the last joins once a row is decoding."""
    import asyncio

    eng = engine(model, **kw)
    try:
        rows = [eng.submit(p, chat=False, max_tokens=n) for p in prompts[:-1]]
        for _ in range(20000):
            if any(r.state == "decode" or r.done for r in rows):
                break
            await asyncio.sleep(0.0005)
        rows.append(eng.submit(prompts[-1], chat=False, max_tokens=n))
        res = await asyncio.gather(*rows)
        return [r.tokens for r in res], [(r.finish_reason, r.error) for r in res]
    finally:
        await eng.aclose()


def reference_tokens(model, prompt, n, kv_bits=None, kv_group_size=64):
    """Greedy tokens from mlx-lm's own generation loop; with kv_bits, on a cache
    quantized from the first token, as the engine's (mlxnb.core.worker.caches.make_row_cache)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from mlxnb.models.tiny import byte_tokenizer

    ids = byte_tokenizer().encode(prompt)
    out = []
    from mlxnb.core.worker.caches import make_row_cache

    try:  # attention on the quantized KV where mlx-lm can, else dequantized
        cache = make_row_cache(model, kv_bits, kv_group_size)
        model(mx.array([ids[:1]]), cache=cache)
        cache = make_row_cache(model, kv_bits, kv_group_size)
    except ValueError:
        cache = make_row_cache(model, kv_bits, kv_group_size, attention="dequantized")
    for tok, _ in generate_step(mx.array(ids), model, max_tokens=n, prompt_cache=cache):
        out.append(int(tok))
        if out[-1] == 257:  # <eos>: the engine's row ends here too
            break
    return out


async def parity(m: Member, prompts=PROMPTS, n=MAX_TOKENS, reference=True,
                 **engine_kw) -> Result:
    """Greedy parity of `m` on the engine: each prompt alone (fresh engine) vs all
    of them batched with the last joining mid-run; and alone vs mlx-lm, prompt 0.
    `engine_kw` go to every Engine (e.g. kv_bits)."""
    r = Result(m.family, m.cache_kinds)
    if not m.ok:
        r.status, r.detail = "skipped", m.reason
        return r
    if reference:  # before any engine fuses the model's projections (same outputs)
        kv = {k: engine_kw[k] for k in ("kv_bits", "kv_group_size") if k in engine_kw}
        try:
            r.reference = reference_tokens(m.model, prompts[0], n, **kv)
        except ValueError:  # a model mlx-lm cannot run this way: the engine says why
            r.reference = None
    try:
        eng = engine(m.model, **dict(engine_kw, prefix_cache=None))
    except ValueError as e:
        r.status, r.detail = "refused", str(e)
        return r
    try:
        alone = await _alone(eng, prompts, n)
    finally:
        await eng.aclose()
    r.alone = [a[0] for a in alone]
    r.batched, ends = await _batched(m.model, prompts, n, engine_kw)
    errs = [e for _, _, e in alone] + [e for _, e in ends]
    if any(errs):
        r.status, r.detail = "error", next(e for e in errs if e)
        return r
    diffs = [(i, _first_diff(a, b)) for i, (a, b) in enumerate(zip(r.alone, r.batched))]
    diffs = [(i, d) for i, d in diffs if d is not None]
    if diffs:
        i, d = diffs[0]
        a, b = r.alone[i], r.batched[i]
        r.status = "mismatch"
        r.detail = (f"batched differs from alone at token {d} of prompt {i} "
                    f"({len(prompts[i])} tokens): {b[d:d + 3]} vs {a[d:d + 3]}; "
                    f"prompts (first token) that differ: "
                    f"{', '.join(f'{i} ({d})' for i, d in diffs)}")
        return r
    if r.reference is not None:
        d = _first_diff(r.alone[0], r.reference)
        if d is not None:
            r.status = "mismatch"
            r.detail = (f"prompt 0: engine differs from mlx_lm at token {d}: "
                        f"{r.alone[0][d:d + 3]} vs {r.reference[d:d + 3]}")
            return r
    r.status = "batched"
    return r


def run_parity(m: Member, **kw) -> Result:
    import asyncio

    try:
        return asyncio.run(parity(m, **kw))
    except Exception as e:  # a crash in the engine or the model is a result too
        return Result(m.family, m.cache_kinds, "error", f"{type(e).__name__}: {e}")


def table(results: List[Result]) -> str:
    def cell(r):
        if r.status == "batched":
            return "batched (greedy parity)"
        first = (r.detail or "").split("\n")[0].split(" (mlxnb batches")[0]
        return f"{r.status}: {first}" if r.status != "skipped" else f"not built: {first}"

    lines = ["| family | cache kinds (tiny instance) | mlxnb |", "|---|---|---|"]
    lines += [f"| {r.family} | {r.cache_kinds or '-'} | {cell(r)} |" for r in results]
    return "\n".join(lines)


def main(argv=None):
    import time

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--table", action="store_true",
                    help="run each family on mlxnb.Engine and print a markdown table")
    ap.add_argument("families", nargs="*")
    a = ap.parse_args(argv)
    members = build_all(a.families or None)
    if not a.table:
        for m in members:
            print(f"{m.family:24} {m.cache_kinds or '-':40} {m.reason or 'ok'}")
        return
    results = []
    for m in members:
        t = time.perf_counter()
        results.append(run_parity(m))
        r = results[-1]
        print(f"{m.family:24} {time.perf_counter() - t:5.2f}s {r.status:9} "
              f"{r.detail[:150]}", file=sys.stderr, flush=True)
    print(table(results))
    counts = Counter(r.status for r in results)
    print("\n" + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))


if __name__ == "__main__":
    sys.exit(main())
