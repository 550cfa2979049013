"""Round 11 probe: how well does document 1's basis represent document 2's keys and values (pre-RoPE)?

    python docs/round11/basis_overlap.py

One pair of the tuning book (seed 100), both documents prefilled through the full cache; for five layers,
the residual energy share of document 2's normalized non-sink keys/values on its own basis, on document 1's,
and on document 1's extended by columns fitted on what it leaves (output: basis-overlap.txt).
"""

from __future__ import annotations

import torch

from s4r.bench.tasks import make_samples
from s4r.config import S4RConfig
from s4r.core.compress import compressible_parts, fit_layer_bases
from s4r.core.subspace import normalize_rows
from s4r.hf.cache import staged_tensors
from s4r.models.loading import load_model
from s4r.runtime.session import Session


def residual_share(x: torch.Tensor, basis: torch.Tensor) -> float:
    """Share of the normalized rows' energy outside the basis's span."""
    x = normalize_rows(x)
    return (1 - torch.matmul(x, basis).pow(2).sum() / x.pow(2).sum()).item()


def main() -> None:
    torch.set_num_threads(1)
    loaded = load_model("smollm2-135m")

    def count(text: str) -> int:
        return len(loaded.tokenizer.encode(text, add_special_tokens=False))

    doc1 = make_samples("niah_single_book", 2048, 8, 100, count, book="pride-and-prejudice")[0]
    doc2 = make_samples("niah_single_book", 2048, 8, 101, count, book="pride-and-prejudice")[0]
    session = Session(loaded, method="full")
    session.ingest(doc1.context, compress=False)
    n1 = session.logical_length
    session.ingest(doc2.context)
    cfg = S4RConfig(ratio=5.0)
    for layer in (2, 8, 15, 22, 28):
        keys, values, _ = staged_tensors(session.cache.layers[layer])
        k_groups, v_groups = compressible_parts(keys, values, cfg, session.rope)
        first = fit_layer_bases(keys[:, :n1], values[:, :n1], cfg, session.rope, 192, 192)
        own = fit_layer_bases(keys, values, S4RConfig(ratio=5.0, sinks=n1), session.rope, 192, 192)
        cells = []
        for name, x, b1, b2, r1, r2 in (("K", k_groups[:, n1 - cfg.sinks :], first.k, own.k, 59, 72),
                                         ("V", v_groups[:, n1 - cfg.sinks :], first.v, own.v, 88, 109)):
            unit = normalize_rows(x)
            left = unit - torch.matmul(torch.matmul(unit, b1[..., :r1]), b1[..., :r1].transpose(1, 2))
            new = torch.linalg.svd(left[0], full_matrices=False).Vh[:60].T[None]
            both = torch.cat([b1[..., :r1], new], dim=-1)
            extended = {extra: round(residual_share(x, torch.linalg.qr(both[0, :, : r1 + extra])[0][None]), 4)
                        for extra in (10, 20, 40)}
            cells.append(f"{name}: own@{r1} {residual_share(x, b2[..., :r1]):.3f} "
                         f"own@{r2} {residual_share(x, b2[..., :r2]):.3f} "
                         f"doc1@{r1} {residual_share(x, b1[..., :r1]):.3f} doc1+x {extended}")
        print(layer, " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
