"""The GPU's Triton kernels of an S4R step (`s4r.kernels.triton_step`: the selected keys' logits, their
weighted value rows) against the eager path, run by Triton's interpreter on the CPU (`TRITON_INTERPRET=1`;
a GPU compiles the same kernels)."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

pytest.importorskip("triton")

from s4r.config import S4RConfig  # noqa: E402
from s4r.core.coef_bands import decode_tails  # noqa: E402
from s4r.core.compress import compress_layer  # noqa: E402
from s4r.core.latent import gather_value_rows, weighted_value_rows  # noqa: E402
from s4r.core.rope import shifted  # noqa: E402
from s4r.core.subspace import head_blocks  # noqa: E402
from tests.test_fused_kernels import D, kv_data, rope_for  # noqa: E402


@pytest.fixture
def interpreted(triton_interpreted):
    return triton_interpreted


def _layer(dtype: torch.dtype, granularity: str, bands: str | None, offset: int = 0, rebuild: str = "auto",
           rank: int = 24):
    cfg = S4RConfig(ratio=None, rank_k=rank, rank_v=rank, pool_kernel=1, granularity=granularity,
                    coef_bands=bands, rebuild_dtype=rebuild)
    keys, values, queries = kv_data(3, 9, 300, dtype)
    return compress_layer(keys, values, queries, cfg, cfg.rank_k, cfg.rank_v, shifted(rope_for(9, 3), offset))


class _Broken:
    """A kernel that fails at its launch, as one Triton cannot compile here would."""

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            raise RuntimeError("no kernel here")
        return launch


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
    assert interpreted.keys_usable(layer, idx)
    got = interpreted.key_logits(layer, qf, idx, 0.125, head_blocks(layer.basis_k, 3))
    assert interpreted._state["failed"] is None
    want = _reference(layer, qf, idx, 0.125)
    assert got.shape == want.shape == (3, 3, k)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_rebuilds_a_wide_rank_in_blocks(interpreted, dtype, monkeypatch):
    """A rank of 80 coefficient columns, keys taken 16 at a time (the last block of the lead and of the
    lower bands partial), value rows 64 at a time: the eager rebuild's logits, the rows' product."""
    monkeypatch.setattr(interpreted, "RANK_BLOCK", 16)
    layer = _layer(dtype, "layer", "8:3,4:4,2:3", rank=80)
    plan = layer.plan_k
    assert plan.lead > 16 and plan.lead % 16 and (plan.rank - plan.lead) % 16, plan
    g = torch.Generator().manual_seed(5)
    qf = torch.randn(3, 3, D, generator=g)
    idx = torch.randperm(layer._n, generator=g)[:50].sort().values[None]
    got = interpreted.key_logits(layer, qf, idx, 0.125, head_blocks(layer.basis_k, 3))
    want = _reference(layer, qf, idx, 0.125)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())
    probs = torch.softmax(torch.randn(3, 3, 50, generator=g), -1)  # the value rows: two column blocks
    z = interpreted.weighted_rows(layer, idx)(probs)
    truth = torch.matmul(probs.double(), _decoded_value_rows(layer, idx))
    assert z.shape[-1] > interpreted.COLUMNS and interpreted._state["failed"] is None
    torch.testing.assert_close(z.double(), truth, rtol=0, atol=1e-6 * truth.abs().max().item())


def test_the_eager_step_rebuilds_through_the_kernel(interpreted, monkeypatch):
    """A layer's step where the kernels serve (here the interpreter; a GPU in use) gives the output of the
    step with them turned off, and both ran."""
    from s4r.kernels import jit

    monkeypatch.setattr(jit, "available", lambda: False)  # the eager step, not the fused CPU one
    layer = _layer(torch.float32, "layer", "8:2,4:3,2:3", rebuild="float32")
    twin = _layer(torch.float32, "layer", "8:2,4:3,2:3", rebuild="float32")
    g = torch.Generator().manual_seed(3)
    query = torch.randn(1, 9, 1, D, generator=g)
    new = torch.randn(1, 3, 1, D, generator=g)
    calls = []
    real_keys, real_values = interpreted.key_logits, interpreted.weighted_rows
    monkeypatch.setattr(interpreted, "key_logits", lambda *a: calls.append("keys") or real_keys(*a))
    monkeypatch.setattr(interpreted, "weighted_rows", lambda *a: calls.append("values") or real_values(*a))
    for lay in (layer, twin):
        lay.update(new, new)
    fused = layer.attend(query, None, None, 0.125)
    assert calls == ["keys", "values"] and layer.selected.shape[-1] > 0
    twin.cfg = dataclasses.replace(twin.cfg, kernels="eager")  # both kernels off
    assert interpreted.serves(layer) and not interpreted.serves(twin)
    eager = twin.attend(query, None, None, 0.125)
    assert calls == ["keys", "values"] and interpreted._state["failed"] is None  # not asked again
    torch.testing.assert_close(fused, eager, rtol=1e-4, atol=1e-4)


def test_a_kernel_that_cannot_compile_leaves_the_eager_path_with_one_line(interpreted, monkeypatch, caplog):
    """Where Triton cannot build the kernel (an unsupported GPU, a compiler error) the eager rebuild
    serves from then on, after one warning naming the error."""
    layer = _layer(torch.float32, "layer", "8:2,4:3,2:3")
    idx = torch.arange(5)[None]
    monkeypatch.setattr(interpreted, "_key_logits_kernel", _Broken())
    with caplog.at_level(logging.WARNING, logger="s4r.kernels"):
        assert interpreted.key_logits(layer, torch.randn(3, 3, D), idx, 0.125,
                                       head_blocks(layer.basis_k, 3)) is None
        assert not interpreted.keys_usable(layer, idx)
    assert [r.getMessage() for r in caplog.records] == [
        "s4r: Triton key rebuild off (RuntimeError: no kernel here); using the eager path"]


def test_the_kernels_serve_only_a_gpu_or_the_interpreter(monkeypatch):
    """On a CPU the kernels never serve, Triton or not (the fused CPU step and the eager path do), and the
    step does not import them."""
    from s4r.layers.lowrank_rebuild import gpu_kernels

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert gpu_kernels(_layer(torch.float32, "layer", "8:2,4:3,2:3")) is None


def _decoded_value_rows(layer, idx: torch.Tensor) -> torch.Tensor:
    """fp64 [H or 1, k, r_v]: the value coefficients of the tokens idx [H or 1, k] as stored: int8 codes
    times their scale, then the lower bands (`decode_tails`)."""
    rows, scale = gather_value_rows(layer.coef_v, layer._sv[:, : layer._n], idx)
    rows = rows.double() * scale.double().unsqueeze(-1)
    if layer._tv is None:
        return rows
    group = torch.arange(idx.shape[0])[:, None] * (layer._tv.shape[0] > 1)  # per-head bases: their own rows
    codes, steps = layer._tv[group, idx], layer._tsv[group, idx]
    return torch.cat([rows, decode_tails(codes, steps, layer.plan_v).double()], dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("granularity", ["layer", "head"])
@pytest.mark.parametrize("bands", ["8:2,4:3,2:3", None])
@pytest.mark.parametrize("k", [1, 32, 77])
def test_value_kernel_is_the_product_of_the_stored_rows(interpreted, dtype, granularity, bands, k):
    """A basis per layer or per head, lower bands or none, token counts on and off the kernel's blocks,
    probabilities of three query rows a head (a slice of a wider softmax, as the step passes them): the
    fp64 product of the probabilities with the rows as stored, to fp32 rounding (the eager path, whose
    planes round the lower bands, within 1e-3), the kernel run (not its fallback)."""
    layer = _layer(dtype, granularity, bands)
    g = torch.Generator().manual_seed(k)
    idx = torch.randperm(layer._n, generator=g)[:k].sort().values[None]
    if granularity == "head":
        idx = idx.expand(3, -1)
    probs = torch.softmax(torch.randn(3, 3, 5 + k, generator=g), -1)[..., 5:]
    weigh = interpreted.weighted_rows(layer, idx)
    assert weigh is not None
    got = weigh(probs)
    assert interpreted._state["failed"] is None
    want = torch.matmul(probs.double(), _decoded_value_rows(layer, idx))
    assert got.shape == want.shape == (3, 3, layer.plan_v.rank)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6 * want.abs().max().item())
    rows, scale = gather_value_rows(layer.coef_v, layer._sv[:, : layer._n], idx)
    tail = layer.planar_tail(idx, keys=False) if layer._tv is not None else None
    eager = weighted_value_rows(probs, rows, scale, tail)
    torch.testing.assert_close(got, eager, rtol=0, atol=1e-3 * want.abs().max().item())


def test_a_value_kernel_that_cannot_compile_leaves_the_gathered_rows(interpreted, monkeypatch, caplog):
    """The value kernel failing at its first launch: its step still gets the gathered rows' product, and
    one warning names the error."""
    layer = _layer(torch.float32, "layer", "8:2,4:3,2:3")
    idx = torch.arange(7)[None]
    probs = torch.softmax(torch.randn(3, 3, 7), -1)
    monkeypatch.setattr(interpreted, "_value_rows_kernel", _Broken())
    with caplog.at_level(logging.WARNING, logger="s4r.kernels"):
        got = interpreted.weighted_rows(layer, idx)(probs)
    rows, scale = gather_value_rows(layer.coef_v, layer._sv[:, : layer._n], idx)
    want = weighted_value_rows(probs, rows, scale, layer.planar_tail(idx, keys=False))
    torch.testing.assert_close(got, want)
    assert [r.getMessage() for r in caplog.records] == [
        "s4r: Triton value rows off (RuntimeError: no kernel here); using the eager path"]
