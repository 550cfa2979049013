"""The GPU's fused key rebuild (`s4r.kernels.triton_rebuild`) against the eager rebuild, run by Triton's
interpreter on the CPU (`TRITON_INTERPRET=1`; a GPU compiles the same kernel)."""

from __future__ import annotations

import importlib
import logging

import pytest
import torch

pytest.importorskip("triton")

from s4r.config import S4RConfig  # noqa: E402
from s4r.core.compress import compress_layer  # noqa: E402
from s4r.core.rope import shifted  # noqa: E402
from s4r.kernels import triton_rebuild  # noqa: E402
from tests.test_fused_kernels import D, kv_data, rope_for  # noqa: E402


@pytest.fixture
def interpreted(monkeypatch):
    """The module's kernels built for the interpreter (Triton picks it when a kernel is defined)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    importlib.reload(triton_rebuild)
    yield triton_rebuild
    monkeypatch.setitem(triton_rebuild._state, "failed", None)


def _layer(dtype: torch.dtype, granularity: str, bands: str | None, offset: int = 0, rebuild: str = "auto"):
    cfg = S4RConfig(ratio=None, rank_k=24, rank_v=24, pool_kernel=1, kernels="eager", granularity=granularity,
                    coef_bands=bands, rebuild_dtype=rebuild)
    keys, values, queries = kv_data(3, 9, 300, dtype)
    return compress_layer(keys, values, queries, cfg, cfg.rank_k, cfg.rank_v, shifted(rope_for(9, 3), offset))


def _reference(layer, qf: torch.Tensor, idx: torch.Tensor, scaling: float) -> torch.Tensor:
    """The eager rebuild in the model's dtype (bf16: the products of its roundings), else in fp32."""
    if layer.dtype == torch.bfloat16:
        return layer._model_dtype_key_logits(qf, idx, scaling)
    return torch.matmul(qf, layer._rotated(layer._rebuilt_keys(idx), idx)).mul_(scaling)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("granularity", ["layer", "head"])
@pytest.mark.parametrize("bands", ["8:2,4:3,2:3", None])
@pytest.mark.parametrize("k", [1, 32, 77])
def test_kernel_is_the_eager_rebuild(interpreted, dtype, granularity, bands, k):
    """A basis per layer or per head, lower bands of 4 and 2 bits or none, token counts on and off the
    kernel's blocks, the rows of three query heads a KV head (padded to the product's 16), a segment's
    rotary offset: the eager rebuild's logits, to fp32 rounding (bf16: the same roundings)."""
    layer = _layer(dtype, granularity, bands, offset=1000 if k == 77 else 0)
    g = torch.Generator().manual_seed(k)
    qf = torch.randn(3, 3, D, generator=g)
    idx = torch.randperm(layer._n, generator=g)[:k].sort().values[None]
    if granularity == "head":
        idx = idx.expand(3, -1)  # a per-head basis gathers every head's own rows
    assert interpreted.usable(layer, idx)
    got = interpreted.key_logits(layer, qf, idx, 0.125)
    want = _reference(layer, qf, idx, 0.125)
    assert got.shape == want.shape == (3, 3, k)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())


def test_the_eager_step_rebuilds_through_the_kernel(interpreted, monkeypatch):
    """A layer's step where the kernel serves (here the interpreter; a GPU in use) gives the output of the
    step with it turned off, and the kernel ran."""
    layer = _layer(torch.float32, "layer", "8:2,4:3,2:3", rebuild="float32")
    twin = _layer(torch.float32, "layer", "8:2,4:3,2:3", rebuild="float32")
    g = torch.Generator().manual_seed(3)
    query = torch.randn(1, 9, 1, D, generator=g)
    new = torch.randn(1, 3, 1, D, generator=g)
    calls = []
    real = interpreted.key_logits
    monkeypatch.setattr(interpreted, "key_logits", lambda *a: calls.append(1) or real(*a))
    for lay in (layer, twin):
        lay.update(new, new)
    fused = layer.attend(query, None, None, 0.125)
    monkeypatch.setattr(interpreted, "usable", lambda layer, idx: False)
    eager = twin.attend(query, None, None, 0.125)
    assert calls and layer.selected.shape[-1] > 0
    torch.testing.assert_close(fused, eager, rtol=1e-4, atol=1e-4)


def test_a_kernel_that_cannot_compile_leaves_the_eager_path_with_one_line(interpreted, monkeypatch, caplog):
    """Where Triton cannot build the kernel (an unsupported GPU, a compiler error) the eager rebuild
    serves from then on, after one warning naming the error."""

    class Broken:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise RuntimeError("no kernel here")
            return launch

    layer = _layer(torch.float32, "layer", "8:2,4:3,2:3")
    idx = torch.arange(5)[None]
    monkeypatch.setattr(interpreted, "_key_logits_kernel", Broken())
    with caplog.at_level(logging.WARNING, logger="s4r.kernels"):
        assert interpreted.key_logits(layer, torch.randn(3, 3, D), idx, 0.125) is None
        assert not interpreted.usable(layer, idx)
    assert [r.getMessage() for r in caplog.records] == [
        "s4r: Triton key rebuild off (RuntimeError: no kernel here); using the eager path"]


def test_the_kernel_serves_only_a_gpu_or_the_interpreter(monkeypatch):
    """On a CPU the kernel never serves, Triton or not (the fused CPU step and the eager rebuild do)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    layer = _layer(torch.float32, "layer", "8:2,4:3,2:3")
    assert not triton_rebuild.usable(layer, torch.arange(5)[None])
