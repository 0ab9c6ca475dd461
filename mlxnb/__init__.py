"""mlxnb: a Jupyter-native continuous-batching LLM engine on MLX.

    %load_ext mlxnb          # then %%generate cells; see README.md

Errors: bad parameters raise ValueError (UsageError in magics) with a one-line
message; a row that fails ends with finish_reason 'error' and `row.error` set.
"""

from ._blas import preload_openblas as _preload_openblas

_preload_openblas()  # before mlx is imported: see _blas.py for why

from .engine import Engine  # noqa: E402
from .rows import Row, RowResult, SamplingParams, StepRecord  # noqa: E402
from .run import Run  # noqa: E402

__all__ = ["Engine", "Row", "RowResult", "Run", "SamplingParams", "StepRecord",
           "load_model"]
__version__ = "0.1.0"


def load_model(name: str = "default"):
    """`(model, tokenizer)` as `mlx_lm.load` returns: 'default', a hub id or a dir."""
    from .models import load_model as _load

    return _load(name)
