"""The weights-read floor of a decode step: every matrix product of one step, alone.

A one-token step reads each weight matrix once. Timing those products on their own (one random vector
each, no norms, no attention, no Python between layers) gives what the step cannot go below at the
machine's bandwidth of the moment; the decode-speed table times it in the same loop as the forks, so the
floor and the steps see the same machine.
"""

from __future__ import annotations

import time

import torch

from s4r.hf.lean_ops import linear
from s4r.kernels.bf16_matvec import MatvecWeight


def _tensor(m: torch.Tensor | MatvecWeight) -> torch.Tensor:
    return m.tensor if isinstance(m, MatvecWeight) else m


class WeightsFloor:
    """The products of a step's matrices with random vectors, timed per call (by the product the step
    runs: a `MatvecWeight` by its kernel)."""

    def __init__(self, name: str, matrices: list[torch.Tensor | MatvecWeight]) -> None:
        self.name = name
        self.matrices = matrices
        g = torch.Generator(device=_tensor(matrices[0]).device).manual_seed(0)
        self.inputs = [torch.randn(1, _tensor(m).shape[1], generator=g, device=_tensor(m).device)
                       .to(_tensor(m).dtype) for m in matrices]
        self.seconds: list[float] = []

    @property
    def nbytes(self) -> int:
        """Bytes of weights one step reads."""
        return sum(_tensor(m).numel() * _tensor(m).element_size() for m in self.matrices)

    def run(self) -> None:
        """One step's products."""
        for w, x in zip(self.matrices, self.inputs, strict=True):
            linear(x, w)

    def time_once(self, keep: bool = True) -> None:
        """Run once; keep the wall-clock seconds unless `keep` is False (warm-up)."""
        t0 = time.perf_counter()
        self.run()
        if keep:
            self.seconds.append(time.perf_counter() - t0)


def model_matrices(model) -> list[torch.Tensor]:
    """The model's own matrices of a step, in its dtype: every decoder layer's linears and the LM head."""
    linears = [m for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    return [m.weight.detach() for m in linears] + [model.get_output_embeddings().weight.detach()]


def lean_matrices(step) -> list[torch.Tensor | MatvecWeight]:
    """A `s4r.hf.lean.LeanStep`'s stacked matrices (q/k/v, o, gate/up, down per layer) and its LM head, as
    its products take them."""
    out = [m for layer in step.products for m in (layer.w_qkv, layer.w_o, layer.w_gate_up, layer.w_down)]
    return [*out, step.head_product]
