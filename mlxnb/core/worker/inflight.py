"""The decode step launched and not yet read back (the pipeline's one step ahead)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import mlx.core as mx


@dataclass
class LogprobArrays:
    """Logprob arrays of the rows that asked, at batch positions `positions`."""

    positions: List[int]
    chosen: mx.array  # [b] the sampled token's logprob
    top_ids: Optional[mx.array]  # [b, k] best alternatives, most likely first
    top_logprobs: Optional[mx.array]  # [b, k]
    # batch position -> tokens its constraint allowed at this step (structured rows)
    allowed: Optional[dict] = None


@dataclass
class InFlight:
    row_ids: List[int]  # the decode batch as launched, in batch order
    tokens: mx.array  # [B] sampled, being computed
    logprobs: Optional[LogprobArrays] = None
    firsts: bool = False  # it carries a joined row's first token (its TTFT)
    # a pipelined verification (wide.py): tokens is [B, W], `accepted` [B] the
    # drafts each row took, `drafts` each row's (by row id)
    accepted: Optional[mx.array] = None
    drafts: Optional[Dict[int, List[int]]] = None
