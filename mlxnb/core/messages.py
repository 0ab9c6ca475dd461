"""What crosses between the event loop and the MLX worker: plain Python values only.

    loop  ── tick(admits: [Admit], cancels: [row id]) ──▶  worker
    loop  ◀──────────────── TickReport ─────────────────  worker
             updates {row id: RowUpdate}   state changes, prefill progress, endings
             emitted [Emitted]             tokens and text deltas, in order
             steps   [StepStat]            one per decode step the tick took

"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, NamedTuple, Optional

from .rows import SamplingParams
from .states import Finish, RowState


class Ending(NamedTuple):
    """Why and how a row ends, as the worker decides it."""

    reason: Finish
    error: Optional[str] = None


@dataclass
class Admit:
    """A row the scheduler admitted: its prompt ids and parameters."""

    row_id: int
    ids: List[int]
    params: SamplingParams


@dataclass
class RowUpdate:
    row_id: int
    state: Optional[RowState] = None
    prefill_done: Optional[int] = None
    cached_tokens: Optional[int] = None
    finish: Optional[Finish] = None
    error: Optional[str] = None
    # A constrained row's output judged on the worker from its matcher (checked):
    # why it falls short of the constraint, or None. Unchecked: the loop checks the
    # text itself.
    checked: bool = False
    constraint_error: Optional[str] = None
    # speculation: drafts this tick verified for the row, and how many it accepted
    draft_proposed: int = 0
    draft_accepted: int = 0


class Emitted(NamedTuple):
    """One read-back for one row: its token (None: text only, as a row ends), the
    text that token made showable, its logprob record if the row asked, and whether
    it was a draft the row accepted (speculation)."""

    row_id: int
    token: Optional[int]
    text: str
    logprob: Optional[dict] = None
    drafted: bool = False


@dataclass
class StepStat:
    decoded: int  # rows in the decode step launched
    prefill_tokens: int
    read: int  # tokens read back
    seconds: float
    kv_bytes: int
    batch_ids: tuple  # rows in the decode batch, each holding `batch_share` bytes
    batch_share: int
    prefill_bytes: Dict[int, int]
    # seconds: (graph build, launch, waiting on the device, the worker's own
    # bookkeeping) -- worker/stepsplit.py
    split: tuple = ()
    drafted: int = 0  # draft tokens this step verified
    accepted: int = 0  # of which the rows accepted (tokens read = rows + accepted)


@dataclass
class TickReport:
    updates: Dict[int, RowUpdate]
    emitted: List[Emitted]
    steps: List[StepStat]
    busy: bool  # more work pending on the worker: tick again without new input
    prefill_chunk: int  # prompt tokens per step beside decoding rows, as it stands
    prefix_bytes: int = 0  # held by the prompt-prefix store (its own cap, not kv_budget)


@dataclass
class LayerPaths:
    """How a model instance's layers decode, as one engine's load set them up (its
    status line says). A later Engine loading on the same instance sets them up
    again for its own settings and marks the earlier record `superseded` (a plain
    flag the worker sets and the loop reads)."""

    superseded: bool = False


@dataclass
class LoadFacts:
    """What the worker measured as it set the model up (Engine keeps these)."""

    cache_kinds: str  # e.g. '24 recurrent-state + 8 attention layers, KV 4-bit'
    layer_costs: List[tuple]  # per layer: (bytes per token, window or 0, fixed bytes)
    quantized_attention: bool  # attention reads quantized KV without dequantizing
    prefix_reuse: str  # 'on', 'off', or 'off for these cache kinds'
    speculation: str = "lookup"  # what rows may speculate with, or 'off: why'
    paths: LayerPaths = field(default_factory=LayerPaths)  # (see LayerPaths)


@dataclass
class WorkerState:
    """What the worker holds right now (Engine.worker_state): for tests, the status
    line and teaching views."""

    busy: bool  # anything left to prefill, decode or read back
    batch: List[int]  # row ids in the decode batch, in batch order
    decoding: List[int]  # rows with host-side decode state (the batch + rows being read)
    prefilling: List[int]  # admitted rows whose prefill has not finished
    ready: int  # prefilled groups waiting to join the batch
    in_flight: bool  # a decode step launched and not yet read
    leaving: int  # rows marked to leave the batch at the next step
    has_batch_cache: bool
    prefix_bytes: int  # held by the prompt-prefix store
    prefill_chunk: int  # prompt tokens per step beside decoding rows, as it stands


class Updates:
    """The RowUpdates a tick collects, one per row touched, in the order touched."""

    def __init__(self):
        self.by_row: Dict[int, RowUpdate] = {}
        self.endings = 0  # rows this tick ended: the streak stops for them

    def of(self, rid: int) -> RowUpdate:
        up = self.by_row.get(rid)
        if up is None:
            up = self.by_row[rid] = RowUpdate(rid)
        return up

    def end(self, rid: int, reason: Finish, error: Optional[str] = None) -> RowUpdate:
        up = self.of(rid)
        if up.finish is None:
            self.endings += 1
        up.finish, up.error = reason, error
        return up

    def ended(self, rid: int) -> bool:
        up = self.by_row.get(rid)
        return up is not None and up.finish is not None
