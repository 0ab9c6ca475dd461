"""The model as the batch runs it, measured once at load (on the worker): its cache
recipe, the bytes each layer's cache takes, whether padding stays out of its rows,
and fused projections."""

from __future__ import annotations

import os
import threading
from typing import List, Optional

import mlx.core as mx

from mlx_lm.models.cache import ArraysCache

from ..._log import Laps
from ..messages import LayerPaths
from . import (caches, gated_delta, gated_delta_prefill, kv_attention, qk_rope, recurrent,
               rows_gemv, short_conv, wide_kernel, wideattn)
from .fuse import fuse_projections
from .caches import empty_batch
from .loadchecks import decode_steps_agree, padding_stays_out, probe_forwards, probe_ids
from .prefill_policy import AUTO_MAX, IDLE_PREFILL
from .prefix import PrefixStore
from .tokens import TOKEN, ids as tokens_of


class BatchModel:
    def __init__(self, model, tokenizer, *, fuse: bool = False,
                 kv_bits: Optional[int] = None, kv_group_size: int = 64,
                 prefill_chunk: Optional[int] = None, verify_kernel: bool = False):
        self.model, self.tokenizer = model, tokenizer
        self.kv_bits, self.kv_group_size = kv_bits, kv_group_size
        self.prefill_chunk = prefill_chunk
        # how attention reads quantized KV (quantized_kv._Quantized): _probe_costs
        # picks, `kv_attention_note` says why it fell back to dequantizing
        self.kv_attention, self.kv_attention_note = "quantized", ""
        probe = self.make_cache()
        bad = caches.unsupported(probe)
        if bad:
            raise ValueError(
                f"mlxnb cannot batch this model: its {', '.join(bad)} cache has no "
                f"batched form (mlxnb batches KVCache, RotatingKVCache, ArraysCache, "
                f"CacheList and quantized KV). Use mlx_lm.generate for it.")
        # the record an earlier engine's status reads (outside the module tree, as
        # recurrent.register's): its layers change from here (fused, re-compiled,
        # kernels swapped), whatever this load does
        before = model.__dict__.get("_mlxnb_paths")
        if before is not None:
            before.superseded = True
        self.paths = model.__dict__["_mlxnb_paths"] = LayerPaths()
        laps = Laps("load")
        # gated_delta_prefill.py: before any forward here (batch.py offered it)
        self.delta_prefill_note = gated_delta_prefill.check(model)
        self.delta_prefill = gated_delta_prefill.taken(model)
        laps("delta-net prefill kernel check")
        self.layer_costs = self._probe_costs()
        laps("cache probes")
        # fuse.py: in place, same outputs; its probe is a fresh 1-token forward
        self.fused = fuse_projections(model, lambda: model(
            tokens_of([[0]]), cache=self.make_cache())) if fuse else 0
        laps("fused projections")
        self.pad_safe = padding_stays_out(model, self.make_cache, probe_ids(self.tokenizer))
        laps("padding check")
        # rows_gemv.py: a few rows through a linear as one GEMV (CUDA), each row's bits
        # as alone; after the padding probe, whose noise floor is a batch change's
        self.linears = rows_gemv.install(model)
        # windows.py: an unpadded decode batch's windows keep their bookkeeping on the
        # host; MLXNB_LEAN_WINDOWS=0 leaves it to mlx-lm (for measuring the two)
        self.lean_windows = os.environ.get("MLXNB_LEAN_WINDOWS", "1") != "0"
        self.dense_note = self._pick_dense_decode()
        laps("decode attention check")
        self.wide_note = self._pick_wide_attention(verify_kernel)
        laps("verification attention check")
        # recurrent.py: recurrent layers decode through compiled steps; the executor
        # sets `decode_gate` (no adapter selected) before any step runs
        self.decode_gate = lambda: True
        self.recurrence = ""  # what compiled gated delta rules run as, if any
        self.short_conv = False  # compiled short convs run as short_conv.py's kernel
        self._live = [True]
        # Compiled steps run on this engine's worker thread alone. MLX keeps traces
        # per thread, keyed by the function's address, and drops a freed function's
        # traces from the cache of the thread that called it last only: a step
        # called on two threads leaves traces that a later function at the same
        # address replays, the old layer's weights and all (mlx/compile.cpp).
        self._thread = threading.get_ident()
        # Steps and kernels another engine put on this model instance are made again
        # for this engine's settings (each is checked and reported as this engine
        # made it); every other live engine's gate is carried over, so it still
        # decides for its rows. A load that fails midway leaves no steps ungated.
        others = recurrent.register(model, self.recurrent_ok)
        recurrent.uncompile(model)
        qk_rope.release(model)
        try:
            self.compiled_layers, self.compile_note = self._compile_recurrent(probe)
            laps("recurrent steps")
            self.qk_rope, self.qk_note = self._adopt_qk_rope()
            laps("attention q/k kernel check")
        except BaseException:
            recurrent.uncompile(model)
            qk_rope.release(model)
            raise
        recurrent.carry(model, others)
        self.cache_kinds = caches.describe(probe, kv_bits, self.kv_attention,
                                           self.kv_attention_note)
        if caches.LeanBatchKVCache.dense_decode:
            self.cache_kinds += ", padded decode attention: fused kernel"
        elif self.dense_note:
            self.cache_kinds += f", padded decode attention: MLX's ({self.dense_note})"
        if self.compiled_layers:
            self.cache_kinds += ", recurrent decode compiled" + {
                "gates": " (gated delta: fused kernel, gates inside)",
                "kernel": " (gated delta: fused kernel)",
                "fast": " (gated delta: mx.fast)"}.get(self.recurrence, "") + (
                " (short conv: fused kernel)" if self.short_conv else "")
        elif self.compile_note:
            self.cache_kinds += f", recurrent decode not compiled ({self.compile_note})"
        if self.delta_prefill:
            self.cache_kinds += ", delta-net prefill: fused kernel" + (
                f" (mlx-lm's at a size where {self.delta_prefill_note})"
                if self.delta_prefill_note else "")
        elif self.delta_prefill_note:
            self.cache_kinds += f", delta-net prefill: mlx-lm's ({self.delta_prefill_note})"
        if self.qk_rope:
            self.cache_kinds += ", one-token q/k norms and RoPE: fused kernel"
        elif self.qk_note:
            self.cache_kinds += f", one-token q/k norms and RoPE: MLX's ({self.qk_note})"
        if self.linears.startswith(("kernel", "gathered")):
            self.cache_kinds += ", few-row linears: " + (
                "gathered GEMV" if self.linears.startswith("gathered") else "GEMV kernel") + (
                " in verifications" if self.linears.endswith("verifications only") else "")
        if self.wide_note:
            self.cache_kinds += f", verification attention: {self.wide_note}"
        # prefix entries are slices of full-attention KV (quantized or not): windows
        # and recurrent states would need a snapshot at the prefix boundary instead
        self.prefix_reusable = PrefixStore.supports(probe)

    def make_cache(self) -> list:
        """A fresh single-row cache of this engine's kinds (KV quantized if asked)."""
        return caches.make_row_cache(self.model, self.kv_bits, self.kv_group_size,
                                     self.kv_attention)

    @property
    def quantized_attention(self) -> bool:
        """Does attention read the quantized KV without dequantizing the whole cache?"""
        return self.kv_attention != "dequantized"

    def _probe_costs(self) -> List[tuple]:
        """caches.layer_costs of a real forward (a token, a chunk, a decode step).
        With kv_bits it also picks how attention reads the quantized KV:
          CUDA         the fused decode kernel (kv_attention.py), if its self-check
                       on this device at the model's shapes agrees with
                       dequantize-then-attend (MLX's CUDA backend has no quantized
                       matmul for attention's shapes)
          Metal, CPU   mlx-lm's quantized matmuls, if they run at these shapes
          otherwise    dequantized (the same bytes held; more moved per step)"""
        def run():
            cache = self.make_cache()
            probe_forwards(self.model, cache)
            mx.eval([c.state for c in cache])
            return cache

        if self.kv_bits is None:
            return caches.layer_costs(run())
        if kv_attention.cuda_backend():
            return self._probe_fused(run)
        try:
            return caches.layer_costs(run())
        except Exception as e:
            self.kv_attention_note = "no quantized matmul for attention's shapes"
            first = e
        self.kv_attention = "dequantized"
        try:
            return caches.layer_costs(run())
        except Exception:
            e = first
        raise ValueError(
            f"this model cannot run with a quantized KV cache (kv_bits="
            f"{self.kv_bits}, kv_group_size={self.kv_group_size}) on this device: "
            f"{' '.join(str(e).split())[:160]} Use a kv_group_size that divides its "
            f"head dim, or no kv_bits.") from None

    def _probe_fused(self, run) -> List[tuple]:
        """The fused kernel where its self-check passes, else dequantized."""
        kv_attention.install()
        self.kv_attention = "fused"
        try:
            with kv_attention.recording() as calls:
                costs = caches.layer_costs(run())
            why = kv_attention.self_check(calls) if calls else ""
        except Exception as e:
            costs, why = None, f"fused kernel failed: {type(e).__name__}: " + \
                " ".join(str(e).split())[:120]
        if costs is not None and calls and not why:
            return costs
        self.kv_attention, self.kv_attention_note = "dequantized", why
        try:
            return caches.layer_costs(run())
        except Exception as e:
            raise ValueError(
                f"this model cannot run with a quantized KV cache (kv_bits="
                f"{self.kv_bits}, kv_group_size={self.kv_group_size}) on this device: "
                f"{' '.join(str(e).split())[:160]} Use a kv_group_size that divides "
                f"its head dim, or no kv_bits.") from None

    def _pick_dense_decode(self) -> str:
        """On CUDA, full-precision KV layers of padded batches decode through
        kv_attention's dense kernel if its self-check at this model's shapes passes;
        returns why not when it does not."""
        Lean = caches.LeanBatchKVCache
        Lean.dense_decode = False
        self._attention_shapes: list = []  # (Hq, Hkv, D, dtypes, scale) of its layers
        if not kv_attention.cuda_backend():
            return ""
        kv_attention.install()
        Lean.dense_decode = True
        try:
            with kv_attention.recording(dense=True) as calls:
                cache = empty_batch(self.make_cache(), 1)  # a batch cache: its mask
                self.model(mx.zeros((1, 3), TOKEN), cache=cache)
                mx.eval(self.model(mx.zeros((1, 1), TOKEN), cache=cache))
            why = kv_attention.self_check_dense(calls) if calls else ""
            self._attention_shapes = calls
        except Exception as e:
            why = f"failed: {type(e).__name__}: " + " ".join(str(e).split())[:120]
        Lean.dense_decode = bool(calls) and not why
        return why

    def _pick_wide_attention(self, wanted: bool) -> str:
        """On CUDA (unless MLXNB_WIDE_ATTENTION=composed), for an engine that speculates
        by default (`wanted`): verifications' attention through wide_kernel.py if its
        self-check at this model's shapes passes; returns what runs ("" elsewhere).
        The check compiles the kernel's eight variants with NVRTC, 11-12 s in a fresh
        process on an H200 host (bench/results/first-token-2026-12-03-h200.md), and
        MLX keeps no custom kernel on disk (kernels_ahead.py): every load would pay
        that, or the first verification in the middle of a run. So an engine whose
        rows speculate only where they ask verifies with the composed attention."""
        wideattn.use_kernel(False)
        if not wide_kernel.wanted():
            return ""
        if not wanted:
            return "composed (Engine(speculate=...) compiles the fused kernel at load)"
        if not self._attention_shapes:
            return "composed (no full-precision attention layer)"
        why = kv_attention.self_check_wide(self._attention_shapes)
        if why:
            return f"composed ({why})"
        wideattn.use_kernel(True)
        return "fused kernel"

    def recurrent_ok(self) -> bool:
        """May this forward replay compiled recurrent steps? Only this engine's own
        forwards, on its worker thread: any other caller of the model (mlx-lm's
        generate, a user's forward) runs mlx-lm's code. (recurrent.py holds this
        method weakly: it goes with the engine.)"""
        return (self._live[0] and threading.get_ident() == self._thread
                and self.decode_gate())

    def _compile_recurrent(self, probe: list):
        """(layers whose decode is compiled, a note for the status line). On CUDA a
        gated delta rule inside runs as gated_delta.py's kernel, else MLX's fused
        op, else mlx-lm's ops: the first whose compiled steps match the plain ones,
        tried first with the short convs inside (LFM2's, the gated delta-net's) as
        short_conv.py's kernels."""
        if not any(type(c) is ArraysCache for c in caches.leaves(probe)):
            return 0, ""
        # the host time saved is measured on CPU; on a GPU the gain is not yet measured,
        # so it can be turned off without touching code
        if os.environ.get("MLXNB_COMPILE_RECURRENT", "1") == "0":
            return 0, ""
        modes = [("ops", False)]
        if kv_attention.cuda_backend():
            gated_delta.install()
            # the short-conv kernels ride with the kernel modes ("gates" also folds
            # the delta-net's q/k norms into its kernel); if they disagree, the gated
            # delta kernels are tried without them
            modes = [(m, False) for m in gated_delta.MODES]
            if short_conv.wanted():
                modes[:0] = [(m, True) for m in short_conv.KERNEL_MODES]
        live = self._live = [True]  # the check's switch: compiled or plain steps
        first = ""
        for mode, convs in modes:
            seen, nconv = gated_delta.SEEN[0], short_conv.SEEN[0]
            n = recurrent.compile_recurrent(self.model, probe, self.recurrent_ok, mode,
                                            convs)
            if not n:
                return 0, ""
            # (plain forwards' delta-net recurrence: mlx-lm's math, not the prefill kernel)
            with gated_delta_prefill.as_reference():
                why = decode_steps_agree(self.model, probe_ids(self.tokenizer), live)
            if not why:
                used = gated_delta.SEEN[0] > seen
                self.recurrence = mode if used else ""
                self.short_conv = short_conv.SEEN[0] > nconv
                return n, ""
            recurrent.uncompile(self.model)
            first = first or why
        return 0, first

    def qk_ok(self) -> bool:
        """May this forward take qk_rope.py's kernel? This engine's own, on its worker
        thread (as recurrent_ok; held weakly, too)."""
        return self._qk_live[0] and threading.get_ident() == self._thread

    def _adopt_qk_rope(self) -> tuple:
        """(adopted, why not): on CUDA, attention layers whose one-token q/k norms and
        RoPE qk_rope.py's kernel computes take it if it matches MLX's ops at their
        sizes (one position for all rows, and one per row) and decode steps with it
        match those without."""
        self._qk_live = [True]
        if not qk_rope.adopt(self.model, self.qk_ok):
            return False, ""
        why = (qk_rope.self_check(self.model)
               or decode_steps_agree(self.model, probe_ids(self.tokenizer), self._qk_live))
        if why:
            qk_rope.release(self.model)
            return False, why
        return True, ""

    def kv_bytes_for(self, length: int, prefilling: bool = True) -> int:
        """Most bytes a row's caches can allocate while it holds `length` tokens."""
        return row_kv_bytes(self.layer_costs, self.prefill_chunk, length, prefilling)


# A decoding row's sliding window holds at most its window plus a verification's
# extra positions (num_draft <= 16, so 17 new tokens on window - 1 kept ones).
DECODE_WINDOW_SLACK = 64


def row_kv_bytes(layer_costs: List[tuple], prefill_chunk: Optional[int],
                 length: int, prefilling: bool = True) -> int:
    """Most bytes a row's caches can allocate while it holds `length` tokens, from
    the per-layer (bytes per token, window or 0, fixed bytes) a probe measured;
    `prefilling`: while its prompt is still being prefilled (and before).
    Plain arithmetic: the loop's scheduler asks it for every admission."""
    # Caches grow in 255/256-token steps from wherever they stand; merges,
    # prefix hits, batch filters and chunks that change size from tick to tick
    # (the idle budget follows a measured rate) leave them at unaligned sizes.
    # A growth that trims to the used length leaves < 256 spare slots, one that
    # doesn't keeps those and adds < 256 more, so n tokens take < n + 512 slots.
    # A sliding window holds window - 1 + chunk tokens while prefilling and is cut
    # to its window when its rows join the decode batch (windows.fit_windows); a
    # recurrent state is the same size at any length.
    alloc = max(length, 1) + 512
    win = max(prefill_chunk or 0, IDLE_PREFILL, AUTO_MAX) if prefilling else DECODE_WINDOW_SLACK
    return sum(fixed + per_tok * (min(alloc, w + win) if w else alloc)
               for per_tok, w, fixed in layer_costs)
