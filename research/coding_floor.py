"""How far S4R's stored keys and values are from the rate-distortion bound at the bits they spend.

    python -m research.coding_floor --ratio 8 --length 4096 --json out.json

One needle sample of the tuning book is prefilled exactly; every layer is compressed at `--ratio` as the
cache would store it, and every stored token is rebuilt from its coefficients (outliers exact). Per layer
and kind, the relative error (lost energy over energy, non-sink tokens) is set beside the least error any
code of the same bits per token could reach on a Gaussian source with the tokens' covariance (reverse
water-filling over its eigenvalues): the gap in dB is what better coding could still buy at that ratio.
The bound within the rank spends the same bits on the best subspace of the stored rank alone; the charged
bound may use more components or fewer, paying for each basis column past the rank out of the same bits.
The bits are the coefficients' (codes, scales and steps per token), not the bases or outliers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from research.practical_code import MENUS, practical_code
from research.progress import ElapsedLog, measuring_parser
from s4r.bench.tasks import TUNING_BOOK, make_samples
from s4r.config import S4RConfig
from s4r.core.budget import KVShape, solve_ranks, token_coef_bytes
from s4r.core.compress import compress_layer, compressible_parts
from s4r.layers.full import staged_tensors
from s4r.layers.lowrank_dense import layer_tokens_reference
from s4r.runtime.session import Session

__all__ = ["basis_column_bits", "charged_bound", "gaussian_bound", "layer_errors", "stored_tokens",
           "water_level"]


def water_level(eigenvalues: torch.Tensor, bits: float) -> float:
    """The reverse water-filling level theta at which a Gaussian source with these covariance eigenvalues
    costs `bits` per vector: each component spends max(0, log2(lambda / theta) / 2) bits and keeps
    min(lambda, theta) of error."""
    lam = eigenvalues.double().clamp_min(0)
    lo, hi = 1e-30, float(lam.max())
    for _ in range(200):  # bisection in log space
        theta = math.sqrt(lo * hi)
        spent = float(torch.clamp(0.5 * torch.log2(lam.clamp_min(1e-300) / theta), min=0).sum())
        lo, hi = (theta, hi) if spent > bits else (lo, theta)
    return hi


def gaussian_bound(eigenvalues: torch.Tensor, bits: float) -> float:
    """Least relative error of any code spending `bits` per vector on a Gaussian source whose covariance
    has these eigenvalues (reverse water-filling, `water_level`), as a share of the total energy."""
    lam = eigenvalues.double().clamp_min(0)
    theta = torch.tensor(water_level(lam, bits), dtype=lam.dtype)
    return float(torch.minimum(lam, theta).sum() / lam.sum())


def basis_column_bits(width: int, dtype_bytes: int, tokens: int) -> float:
    """Bits per stored token that one more basis column of `width` rows costs over `tokens` tokens."""
    return 8.0 * width * dtype_bytes / max(tokens, 1)


def charged_bound(eigenvalues: torch.Tensor, bits: float, rank: int, column_bits: float) -> tuple[float, int]:
    """`gaussian_bound` for a code that also pays for its basis: coding the top m components costs
    `column_bits` per vector for each basis column past `rank` (and frees as much for each one short of
    it), so they share `bits - (m - rank) * column_bits`. The least relative error over m, and that m."""
    lam = eigenvalues.double().clamp_min(1e-300).sort(descending=True).values
    d, total = lam.numel(), float(lam.sum())
    log_lam = lam.log2()
    zero = lam.new_zeros(1)
    prefix = torch.cat([zero, log_lam.cumsum(0)])  # prefix[j]: the top j components' log2 energies
    tail = total - torch.cat([zero, lam.cumsum(0)])  # tail[j]: the energy past the top j
    j = torch.arange(1, d + 1, dtype=lam.dtype)
    spend = bits - (j - rank) * column_bits  # [m]: the bits m paid components share
    log_theta = (prefix[1:].unsqueeze(0) - 2 * spend.unsqueeze(1)) / j.unsqueeze(0)  # [m, j]
    # water-filling over the top m keeps the components above their own level: a prefix of j <= m
    above = (log_lam.unsqueeze(0) > log_theta) & (j.unsqueeze(0) <= j.unsqueeze(1))
    active = above.sum(dim=1)  # [m]
    theta = torch.where(active > 0, log_theta.gather(1, (active - 1).clamp_min(0).unsqueeze(1))[:, 0].exp2(),
                        lam.new_zeros(d))
    error = (active * theta + tail[active]) / total
    best = int(error.argmin())
    return float(error[best]), best + 1


def stored_tokens(layer, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The non-sink tokens [H, n, d] an S4R `layer` stores, rebuilt from their coefficients, its outliers
    exact (taken from the staged `keys`/`values` [H, T, d] it was compressed from)."""
    s = layer.sinks
    k_hat, v_hat = torch.empty_like(keys[:, s:]), torch.empty_like(values[:, s:])
    layer_tokens_reference(layer, k_hat, v_hat)
    if layer.out_idx is not None:
        idx = layer.out_idx.long()
        k_hat[:, idx], v_hat[:, idx] = keys[:, s + idx], values[:, s + idx]
    return k_hat, v_hat


def layer_errors(keys: torch.Tensor, values: torch.Tensor, cfg: S4RConfig, rank_k: int, rank_v: int,
                 rope) -> dict[str, dict[str, float]]:
    """For one staged layer (post-RoPE keys and values [H, T, d]): per kind, the stored tokens' relative
    error, the coefficient bits per token and the Gaussian bound at those bits."""
    layer = compress_layer(keys, values, None, cfg, rank_k, rank_v, rope)
    s, n = layer.sinks, layer.stored_coefs
    k_hat, v_hat = stored_tokens(layer, keys, values)
    k_pre, v_pre = compressible_parts(keys, values, cfg, rope)  # the spaces the bases live in
    out = {}
    for kind, exact, approx, pre, rank, is_v in (("K", keys[:, s:], k_hat, k_pre, rank_k, False),
                                                  ("V", values[:, s:], v_hat, v_pre, rank_v, True)):
        err = float((exact.float() - approx.float()).pow(2).sum() / exact.float().pow(2).sum())
        bits = 8 * token_coef_bytes(cfg, rank, keys.element_size(), values=is_v)
        x = pre.transpose(0, 1).reshape(n, -1)  # a token's basis groups as one vector
        eig = torch.linalg.eigvalsh(x.double().T @ x.double() / n)
        bound = gaussian_bound(eig, bits * pre.shape[0])
        # the same bits on the best `rank`-dimensional subspace only: the rest of the bound's gain is
        # the fractions of a bit it spends on the components past the stored rank
        top = eig.flip(0)[: rank * pre.shape[0]]
        in_rank = (gaussian_bound(top, bits * pre.shape[0]) * float(top.sum())
                   + float(eig.sum() - top.sum())) / float(eig.sum())
        # and with each basis column past the stored rank paid for out of the same bytes
        column = basis_column_bits(x.shape[1], keys.element_size(), n)
        charged, _ = charged_bound(eig, bits * pre.shape[0], rank * pre.shape[0], column)
        # codes that run, at the same bits with their bases paid (`research.practical_code`)
        total = bits * pre.shape[0] + rank * pre.shape[0] * column
        practical = {menu: float((x.float() - practical_code(x, total, column, menu).float()).pow(2).sum()
                                 / x.float().pow(2).sum()) for menu in MENUS}
        out[kind] = {"error": err, "bits": bits * pre.shape[0], "bound": bound, "bound_in_rank": in_rank,
                     "bound_charged": charged, "scalar_code": practical["scalar"],
                     "vector_code": practical["vector"],
                     "gap_db": 10 * math.log10(err / max(bound, 1e-30))}
    return out


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m research.coding_floor [--ratio 8] [--length 4096] [--seed 0] [--json PATH]`."""
    from s4r.models.loading import load_model

    parser = measuring_parser("python -m research.coding_floor", main.__doc__, length=4096, book=TUNING_BOOK)
    parser.add_argument("--ratio", type=float, default=8.0)
    parser.add_argument("--task", default="niah_multivalue")
    args = parser.parse_args(argv)
    loaded = load_model(args.model)
    note = ElapsedLog()
    tok = loaded.tokenizer
    sample = make_samples(args.task, args.length, 1, args.seed,
                          lambda s: len(tok.encode(s, add_special_tokens=False)), book=args.book)[0]
    staged = Session(loaded, method="full")
    staged.ingest(sample.context, compress=False)
    cfg = S4RConfig(ratio=args.ratio)
    shape = KVShape.from_config(loaded.model.config, loaded.dtype.itemsize)
    plan = solve_ranks(shape, cfg, staged.logical_length)
    rows = []
    for i, layer in enumerate(staged.cache.layers):
        keys, values, _ = staged_tensors(layer)
        rows.append(layer_errors(keys, values, cfg, plan.rank_k, plan.rank_v, staged.rope))
        note(f"layer {i}: " + ", ".join(f"{k} error {r['error']:.4f} bound {r['bound']:.4f} "
                                         f"({r['gap_db']:+.1f} dB)"
                                         for k, r in rows[-1].items()))
    summary = {}
    for kind in ("K", "V"):
        err = sum(r[kind]["error"] for r in rows) / len(rows)
        bound = sum(r[kind]["bound"] for r in rows) / len(rows)
        in_rank = sum(r[kind]["bound_in_rank"] for r in rows) / len(rows)
        charged = sum(r[kind]["bound_charged"] for r in rows) / len(rows)
        scalar_code = sum(r[kind]["scalar_code"] for r in rows) / len(rows)
        vector_code = sum(r[kind]["vector_code"] for r in rows) / len(rows)
        gaps = sorted(r[kind]["gap_db"] for r in rows)
        summary[kind] = {"error": err, "bound": bound, "bound_in_rank": in_rank, "bound_charged": charged,
                         "scalar_code": scalar_code, "vector_code": vector_code,
                         "gap_db_median": gaps[len(gaps) // 2],
                         "gap_db_min": gaps[0], "gap_db_max": gaps[-1], "bits": rows[0][kind]["bits"]}
        rank = plan.rank_k if kind == "K" else plan.rank_v
        print(f"{kind}: rank {rank}, {rows[0][kind]['bits']} bits/token, "
              f"mean error {err:.4f}, mean bound {bound:.4f} ({in_rank:.4f} within the rank, "
              f"{charged:.4f} paying for its basis; codes that run: scalar {scalar_code:.4f}, "
              f"vector {vector_code:.4f}), "
              f"gap median {gaps[len(gaps) // 2]:+.1f} dB "
              f"[{gaps[0]:+.1f}, {gaps[-1]:+.1f}] over {len(rows)} layers")
    note.finish(args.json, {"ratio": args.ratio, "rank_k": plan.rank_k, "rank_v": plan.rank_v,
                            "layers": rows, "summary": summary})


if __name__ == "__main__":
    main()
