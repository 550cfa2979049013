"""The one-token bf16 product (`s4r.kernels.bf16_matvec`) against the exact product of the same bf16
operands, and the lean decode step with it against the step with torch's products."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("numba")

from s4r.hf import lean  # noqa: E402
from s4r.kernels import bf16_matvec, jit  # noqa: E402
from s4r.kernels.jit import as_numpy  # noqa: E402
from tests.helpers import counted_kernel, failing_kernel  # noqa: E402
from tests.test_lean_step import STEPS, _decode, _model  # noqa: E402

pytestmark = pytest.mark.skipif(not bf16_matvec.available(), reason="no AVX512-BF16 here")


def _operands(rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-2, 1, cols)  # columns of very different sizes: sums that cancel and that don't
    weight = (torch.randn(rows, cols, generator=g) * scale).bfloat16()
    return weight, torch.randn(cols, generator=g).bfloat16()


def _assert_rounded_exact(got: torch.Tensor, weight: torch.Tensor, x: torch.Tensor) -> None:
    """got is the fp64 product of the bf16 operands rounded once to bf16 (fp32 sums in another order:
    within a bf16 step of it, plus the fp32 sums' own error)."""
    exact = weight.double() @ x.double()
    bound = 2.0**-8 * exact.abs() + 1e-6 * (weight.double().abs() @ x.double().abs())
    assert ((got.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("parts", [1, 2])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9, 130])
@pytest.mark.parametrize("cols", [1, 31, 32, 33, 64, 100, 576])
def test_matvec_is_the_bf16_product_rounded(rows, cols, parts):
    """Rows in runs of four and alone, columns in whole 32-value chunks and the rest; the rows split over
    threads; nothing written past the last row."""
    weight, x = _operands(rows, cols, rows * 1000 + cols)
    out = torch.full((rows + 3,), 7.0, dtype=torch.bfloat16)
    bf16_matvec.bf16_matvec(as_numpy(x), as_numpy(weight), as_numpy(out), parts)
    _assert_rounded_exact(out[:rows], weight, x)
    assert (out[rows:] == 7.0).all()


def test_matvec_mostly_equals_torchs_product_bit_for_bit():
    weight, x = _operands(3072, 576, 0)
    got = bf16_matvec.MatvecWeight(weight).product(x.view(1, 1, -1))
    want = F.linear(x.view(1, 1, -1), weight)
    assert got.shape == want.shape == (1, 1, 3072) and got.dtype == torch.bfloat16
    assert (got == want).float().mean() > 0.98  # the rest a bf16 step apart: the sums' order


def test_a_weight_takes_any_one_row_and_leaves_more_rows_to_torch():
    weight, x = _operands(40, 96, 1)
    w = bf16_matvec.MatvecWeight(weight)
    strided = torch.zeros(1, 1, 192)[..., ::2]
    strided.copy_(x.float().view(1, 1, -1))
    _assert_rounded_exact(w.product(strided).view(-1), weight, x)  # fp32 and strided: rounded, copied
    rows = torch.randn(3, 96).bfloat16()
    torch.testing.assert_close(w.product(rows), F.linear(rows, weight), rtol=0, atol=0)


def test_a_failing_kernel_falls_back_to_torchs_product_once(monkeypatch):
    calls = failing_kernel(monkeypatch, bf16_matvec, "bf16_matvec")
    weight, x = _operands(8, 64, 2)
    w = bf16_matvec.MatvecWeight(weight)
    want = F.linear(x, weight)
    for _ in range(2):
        torch.testing.assert_close(w.product(x), want, rtol=0, atol=0)
    assert calls == [1] and not w.fused and jit._state["failed"]


def test_only_bf16_cpu_matrices_become_matvec_weights():
    bf16, fp32 = torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(4, 8)
    out = bf16_matvec.matvec_weights([bf16, fp32, bf16.t()])
    assert isinstance(out[0], bf16_matvec.MatvecWeight) and out[1] is fp32 and out[2].shape == (8, 4)
    with pytest.raises(ValueError):
        bf16_matvec.MatvecWeight(fp32)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_lean_step_with_the_kernel_gives_torchs_logits(arch, monkeypatch):
    """A bf16 model's lean step (its products by the kernel) against the same step with torch's products:
    the same logits up to a bf16 step; the kernel ran for every matrix of every step."""
    model = _model(arch, dtype=torch.bfloat16)
    calls = counted_kernel(monkeypatch, bf16_matvec, "bf16_matvec")
    reference = _decode(model, "lean-torch")
    assert not calls
    got = _decode(model, "lean-eager")
    step = lean.lean_step(model, "lean-eager")
    # every step: four matrices a layer and the LM head
    assert step.matvec and len(calls) == STEPS * (4 * len(step.layers) + 1)
    err = (got.float() - reference.float()).abs().max().item()
    assert err < 0.02 * reference.float().abs().max().item()
