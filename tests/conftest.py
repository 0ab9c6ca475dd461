import asyncio

import pytest

import mlxnb  # noqa: F401  (first: it puts OpenBLAS under MLX; see mlxnb/models/blas.py)


@pytest.fixture(scope="session")
def tiny():
    """A random-weight 2-layer llama with a byte-level tokenizer (milliseconds)."""
    from mlxnb.models.tiny import tiny_model

    return tiny_model()


@pytest.fixture(scope="session")
def tiny_swa():
    """The same shape with sliding-window (rotating) caches of 16 tokens."""
    from mlxnb.models.tiny import tiny_model

    return tiny_model(sliding_window=16)


@pytest.fixture
def patient_submits(monkeypatch):
    """A constrained submit waits for its compile's verdict as long as the compile
    may take (its own bound), not SUBMIT_WAIT_S: tests of the errors a submit raises
    do not turn, on a loaded machine, into tests of the rows a slow compile ends
    (test_constrain_async.py has those)."""
    from mlxnb.core import constrain, submitting

    monkeypatch.setattr(submitting, "SUBMIT_WAIT_S", constrain.COMPILE_TIMEOUT_S)


@pytest.fixture
def patient_connect(monkeypatch):
    """`%mlxnb connect` waits for its probe as long as the probe may take, not
    CONNECT_WAIT_S: on a loaded machine even a local server's answer can come later,
    and tests that need a connected engine do not turn into tests of that wait
    (test_remote_edges.py has those)."""
    from mlxnb.notebook import connecting

    monkeypatch.setattr(connecting, "CONNECT_WAIT_S", 10.0)


@pytest.fixture
def arun():
    """Run a coroutine function on a fresh loop: arun(main, *args)."""

    def run(fn, *args, timeout=60):
        async def guarded():
            return await asyncio.wait_for(fn(*args), timeout)

        return asyncio.run(guarded())

    return run
