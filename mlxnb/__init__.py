"""mlxnb: a Jupyter-native continuous-batching LLM engine on MLX.

    %load_ext mlxnb          # then %%generate cells; see README.md

Errors: bad parameters raise ValueError (UsageError in magics) with a one-line
message; a row that fails ends with finish_reason 'error' and `row.error` set:

    ValueError            bad parameter, empty prompt, never fits budget/context
    ModelLoadError        (a ValueError) unknown model name, not an mlx-lm dir
    RowResult.error       why a row ended with 'error' (callback, forward, prefill,
                          or a server's refusal with mlxnb.connect)
"""

from .models.blas import preload_openblas as _preload_openblas
from .models.kernel_cache import use_user_cache as _use_user_cache

_preload_openblas()  # before anything imports mlx: see models/blas.py for why
_use_user_cache()  # likewise: models/kernel_cache.py


def load_ipython_extension(ip):  # `%load_ext mlxnb`
    from .notebook.magics import load_ipython_extension as load

    load(ip)


def unload_ipython_extension(ip):
    from .notebook.magics import unload_ipython_extension as unload

    unload(ip)


__all__ = ["Engine", "Row", "RowResult", "Run", "SamplingParams", "StepRecord",
           "GenerationWidget", "load_model", "wait", "connect", "load_ipython_extension",
           "unload_ipython_extension"]
__version__ = "0.1.0"

# `%load_ext mlxnb` must stay cheap: mlx-lm (and transformers under it) load on
# first use of these names, not at import.
_LAZY = {
    "Engine": ".core.engine", "Row": ".core.rows", "RowResult": ".core.rows",
    "Run": ".core.run", "SamplingParams": ".core.rows", "StepRecord": ".core.rows",
    "GenerationWidget": ".notebook.widget", "load_model": ".models.loading",
    "ModelLoadError": ".models.loading", "wait": ".notebook.session",
    "connect": ".remote", "RemoteEngine": ".remote", "EngineLike": ".core.protocol",
}


def __getattr__(name):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'mlxnb' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(mod, __name__), name)
    globals()[name] = value
    return value
