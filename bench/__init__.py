"""mlxnb's benchmarks: `python -m bench --help` lists them; bench/README.md says what
each measures and where its results go."""
