"""Shared fixtures. Plain helpers (tiny_model, CharTokenizer) live in tests/helpers.py."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from s4r.models.loading import LoadedModel

# the CLI tests' shared fixtures (cli_fakes, book)
pytest_plugins = ["tests.cli_fixtures"]


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    """The real embedded SmolLM2-135M on CPU in the auto dtype (bf16 where the CPU has it, else fp32).

    Uses $S4R_HOME when set (else ~/.cache/s4r); the first run downloads and converts it (~20 s).
    Tests using it must be marked ``@pytest.mark.slow``.
    """
    # Imported here so collecting the fast tests never pays for (or depends on) the loader's imports.
    from s4r.models.loading import load_model

    return load_model("smollm2-135m", device="cpu", dtype="auto")


@pytest.fixture
def triton_interpreted(monkeypatch):
    """`s4r.kernels.triton_step` rebuilt for Triton's interpreter (Triton picks it when a kernel is defined,
    from TRITON_INTERPRET); skipped where Triton is not installed."""
    pytest.importorskip("triton")
    import importlib

    from s4r.kernels import triton_step

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    importlib.reload(triton_step)
    triton_step._state["failed"] = None
    yield triton_step
    triton_step._state["failed"] = None  # a test's failed kernel stays in that test
