"""Model name -> directory -> mlx_lm.load; the bundled GGUF; the BLAS preload; tiny models.

Importing this package must not import mlx: `mlxnb/__init__.py` preloads OpenBLAS from
`blas.py` before anything else does.
"""
