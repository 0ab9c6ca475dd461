"""Row states and finish reasons.

`str` enums: they compare, hash, print and save as their plain values ("decode",
"stop"), which is what users, widgets and saved files see.
"""

from enum import Enum


class _StrEnum(str, Enum):
    # Members are their values everywhere a user looks: str(), f-strings, JSON,
    # dict keys. (enum.StrEnum is 3.11+; hashing as the value is not its default.)
    __str__ = str.__str__
    __format__ = str.__format__
    __hash__ = str.__hash__


class RowState(_StrEnum):
    QUEUED = "queued"  # waiting for room in the batch (scheduler.py)
    PREFILL = "prefill"  # admitted: its prompt is being prefilled
    DECODE = "decode"  # in the decode batch
    DONE = "done"  # ended: see its finish reason


class Finish(_StrEnum):
    STOP = "stop"  # end of sequence, a stop string, or a complete constraint
    LENGTH = "length"  # max_tokens reached
    CANCELLED = "cancelled"
    ERROR = "error"  # see the row's `error`
