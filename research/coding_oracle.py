"""Where S4R's answers go past 5x: its store read without selection, and the best code at its bits.

    python -m research.coding_oracle --ratios 8,10 --book romeo-and-juliet --length 4096 --samples 20 \
        --tasks niah_single_book,niah_multikey --json out.json

Every sample is prefilled once, exactly, and answered greedily (scored as `s4r bench` scores) by:
- `full`: the exact cache;
- `s4r@R`: the method as it runs (latent scoring, the selected tokens rebuilt);
- `stored@R`: every token `s4r@R` stores, rebuilt from its coefficients (sinks and outliers exact), in
  an exact cache read by exact attention: its gap to `s4r@R` is what the selection loses;
- `bound@R`: every non-sink token through the Gaussian rate-distortion test channel at the coefficient
  bits `s4r@R` spends per token in that layer (reverse water-filling over the tokens' covariance in the
  spaces S4R's bases live in, `research.coding_floor`), in an exact cache: what a transform code that
  reaches the bound would score at those bits, with nothing lost to selection;
- `charged@R`: the same channel, its bits also paying for each basis column past `s4r@R`'s ranks (the
  bound charges the coefficients only; at a few thousand tokens a 192-wide bf16 column costs ~0.8 bits
  per token), over the number of components `research.coding_floor.charged_bound` finds best;
- `scalar@R` and `vector@R`: codes that run (`research.practical_code`) in the same bits, their bases
  paid: the tokens' eigenbasis, each component's quantizer allocated from a menu of the scalar bands S4R
  stores, or with vector quantizers for the fractions of a bit: what a better store could keep;
  `vector-values@R`: s4r's stored keys, the values in that vector code.
The JSON is `s4r bench --json`'s accuracy record, so `research.merge_runs` tabulates it (paired gaps).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict

import torch

from research.coding_floor import basis_column_bits, charged_bound, stored_tokens, water_level
from research.practical_code import MENUS, practical_code
from research.progress import ElapsedLog, measuring_parser
from s4r.bench.config import BenchConfig
from s4r.bench.records import AccuracyRecord
from s4r.bench.scoring import score
from s4r.bench.tasks import Sample, answer_budget, make_samples
from s4r.config import S4RConfig
from s4r.core.budget import token_coef_bytes
from s4r.core.compress import compressible_parts
from s4r.core.rope import RopeFn, apply_rope
from s4r.layers.full import FullLayer
from s4r.runtime.session import Session

__all__ = ["ORACLES", "bound_coder", "coded_tokens", "exact_copy", "gaussian_channel", "oracle_forks",
           "practical_coder"]

Replace = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def gaussian_channel(x: torch.Tensor, bits: float, generator: torch.Generator,
                     components: int | None = None) -> torch.Tensor:
    """Vectors `x` [n, D] as the Gaussian rate-distortion test channel at `bits` per vector returns them:
    in the eigenbasis of their covariance, a component of variance lambda above the water level theta
    becomes a * y + noise (a = 1 - theta / lambda, noise variance a * theta), one below it becomes 0; each
    keeps min(lambda, theta) of squared error, the least any code of those bits reaches on a Gaussian.
    `components`: only the top ones get bits (the others become 0)."""
    xd = x.double()
    lam, vec = torch.linalg.eigh(xd.T @ xd / x.shape[0])  # ascending
    lam = lam.clamp_min(0)
    if components is not None:
        lam[: max(lam.numel() - components, 0)] = 0
    theta = water_level(lam, bits)
    gain = (1 - theta / lam.clamp_min(1e-300)).clamp_min(0)
    noise = (gain * theta).sqrt()
    y = xd @ vec
    z = torch.randn(y.shape, generator=generator, dtype=torch.float64)
    return ((gain * y + noise * z) @ vec.T).to(x.dtype)


def _to_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[G, n, width] basis groups -> [H, n, d] per head (inverse of `s4r.layers.full.to_groups`)."""
    if x.shape[0] == heads:
        return x
    return x[0].reshape(x.shape[1], heads, -1).transpose(0, 1)


Coder = Callable[[torch.Tensor, float, int, float], torch.Tensor]


def bound_coder(generator: torch.Generator, charge_bases: bool = False) -> Coder:
    """`gaussian_channel` as a coder of (vectors [n, D], bits per vector, S4R's rank, bits per basis
    column). `charge_bases`: the bits also pay for each basis column past S4R's rank, over the
    components `research.coding_floor.charged_bound` finds best."""
    def code(x: torch.Tensor, bits: float, rank: int, column: float) -> torch.Tensor:
        used = None
        if charge_bases:
            xd = x.double()
            _, used = charged_bound(torch.linalg.eigvalsh(xd.T @ xd / x.shape[0]), bits, rank, column)
            bits -= (used - rank) * column
        return gaussian_channel(x, bits, generator, used)
    return code


def practical_coder(menu: str) -> Coder:
    """`research.practical_code.practical_code` with that menu, its basis columns paid out of S4R's
    coefficient bits plus what S4R's own basis costs."""
    return lambda x, bits, rank, column: practical_code(x, bits + rank * column, column, menu)


def coded_tokens(keys: torch.Tensor, values: torch.Tensor, cfg: S4RConfig, rank_k: int, rank_v: int,
                 rope: RopeFn | None, code: Coder) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-sink keys and values [H, n, d] (post-RoPE, model dtype) of one layer through `code` at the
    coefficient bits per token S4R stores at these ranks (all basis groups of a token coded as one
    vector, as `research.coding_floor` bounds them), in the spaces S4R's bases live in."""
    heads, total, _ = keys.shape
    s = min(cfg.sinks, total)
    out = []
    parts = compressible_parts(keys, values, cfg, rope)
    for pre, rank, is_v in zip(parts, (rank_k, rank_v), (False, True), strict=True):
        groups, n, width = pre.shape
        bits = 8 * token_coef_bytes(cfg, rank, keys.element_size(), values=is_v) * groups
        x = pre.transpose(0, 1).reshape(n, -1)
        coded = code(x, bits, rank * groups, basis_column_bits(x.shape[1], keys.element_size(), n))
        out.append(_to_heads(coded.reshape(n, groups, width).transpose(0, 1), heads))
    k_hat, v_hat = out
    if cfg.key_space == "pre_rope":
        cos, sin = (t.float() for t in rope(torch.arange(s, total)))
        k_hat = apply_rope(k_hat, cos, sin)
    return k_hat.to(keys.dtype), v_hat.to(values.dtype)


def exact_copy(staged: Session, replace: Replace, sinks: int) -> Session:
    """A full-cache fork of `staged` whose non-sink tokens of layer i are `replace(i, keys, values)`."""
    fork = staged.fork(method="full", ratio=1.0)
    for i, layer in enumerate(fork.cache.layers):
        keys, values = layer.keys_view, layer.values_view  # [1, H, T, d]
        k_new, v_new = replace(i, keys[0], values[0])
        k, v = keys.clone(), values.clone()
        k[0, :, sinks:], v[0, :, sinks:] = k_new, v_new
        fork.cache.layers[i] = FullLayer.from_state({"k": k, "v": v}, {})
    return fork


ORACLES = ("stored", "bound", "charged", "vector", "scalar", "vector-values")


def oracle_forks(staged: Session, s4r: Session, seed: int,
                 names: Sequence[str] = ORACLES) -> dict[str, Session]:
    """Exact-cache forks of `staged`, by name: "stored", the tokens S4R fork `s4r` stores, rebuilt;
    "bound", every token through `gaussian_channel` at the bits `s4r` spends per token in each layer;
    "charged", the same with those bits also paying for basis columns past `s4r`'s ranks; "scalar" and
    "vector", `research.practical_code` in those bits; "vector-values", the stored keys with the values
    in the vector code (outliers exact). "bound" draws its noise from `seed`, "charged" from seed + 1."""
    layers = s4r.cache.layers
    sinks = layers[0].sinks

    def coded(code: Coder) -> Replace:
        def replace(i: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            layer = layers[i]
            return coded_tokens(keys, values, layer.cfg, layer.basis_k.shape[-1], layer.basis_v.shape[-1],
                                staged.rope, code)
        return replace

    def vector_values(i: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        layer = layers[i]
        k_hat, v_stored = stored_tokens(layer, keys, values)
        _, v_hat = coded_tokens(keys, values, layer.cfg, layer.basis_k.shape[-1], layer.basis_v.shape[-1],
                                staged.rope, practical_coder("vector"))
        if layer.out_idx is not None:  # the outliers s4r keeps exact stay exact
            idx = layer.out_idx.long()
            v_hat[:, idx] = v_stored[:, idx]
        return k_hat, v_hat

    def make(name: str) -> Replace:
        if name == "stored":
            return lambda i, keys, values: stored_tokens(layers[i], keys, values)
        if name == "vector-values":
            return vector_values
        if name in MENUS:
            return coded(practical_coder(name))
        generator = torch.Generator().manual_seed(seed + (name == "charged"))
        return coded(bound_coder(generator, charge_bases=name == "charged"))

    return {name: exact_copy(staged, make(name), sinks) for name in names}


def answer(session: Session, sample: Sample, index: int, method: str, ratio: float, length: int,
           budget: int, stored: Session) -> AccuracyRecord:
    """The bench's accuracy record of `session`'s greedy answer, with the bytes `stored` (the fork whose
    store it stands for, not yet asked anything) keeps, as the bench takes them after ingest."""
    mem = stored.memory()
    t0 = time.perf_counter()
    text, _ = session.ask(sample.question, prime=sample.answer_prefix, max_new_tokens=budget)
    return AccuracyRecord(task=sample.task, length=length, tokens=session.document_tokens, sample=index,
                          depth=sample.depth, method=method, ratio=ratio, score=float(score(sample, text)),
                          answer=text, achieved_ratio=mem.ratio, stored_bytes=mem.stored_bytes,
                          full_bytes=mem.full_bytes, compress_seconds=stored.compress_seconds,
                          max_new_tokens=budget, answer_seconds=time.perf_counter() - t0)


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m research.coding_oracle [--ratios 8,10] [--samples 20] [--tasks ...] [--first-index 0]`."""
    from s4r.models.loading import load_model

    parser = measuring_parser("python -m research.coding_oracle", __doc__, length=4096,
                              book="romeo-and-juliet")
    parser.add_argument("--ratios", default="8,10")
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--tasks", default="niah_single_book,niah_multikey,niah_multivalue,niah_multiquery")
    parser.add_argument("--first-index", type=int, default=0,
                        help="sample index of the first sample in the record (to merge runs of other seeds)")
    parser.add_argument("--methods", default="full,s4r," + ",".join(ORACLES),
                        help=f"which answer: full, s4r and any of {', '.join(ORACLES)}")
    args = parser.parse_args(argv)
    ratios = [float(r) for r in args.ratios.split(",") if r]
    methods = [m for m in args.methods.split(",") if m]
    if unknown := set(methods) - {"full", "s4r", *ORACLES}:
        parser.error(f"unknown method(s) {', '.join(sorted(unknown))}")
    oracles = [m for m in ORACLES if m in methods]
    loaded = load_model(args.model)
    tok = loaded.tokenizer

    def count(s: str) -> int:
        return len(tok.encode(s, add_special_tokens=False))

    note, cap = ElapsedLog(), BenchConfig().max_new_tokens
    drawn = {t: make_samples(t, args.length, args.samples, args.seed, count, book=args.book)
             for t in args.tasks.split(",") if t}
    records: list[AccuracyRecord] = []
    for k in range(args.samples):
        for task, samples in drawn.items():
            sample, index = samples[k], args.first_index + k
            budget = answer_budget(sample, count, cap)
            staged = Session(loaded, method="full")
            staged.ingest(sample.context, compress=False)
            rows = []
            if "full" in methods:
                full = staged.fork(method="full", ratio=1.0)
                rows.append(answer(full, sample, index, "full", 1.0, args.length, budget, full))
            for ratio in ratios:
                s4r = staged.fork(method="s4r", ratio=ratio)
                forks = oracle_forks(staged, s4r, 1000 * index + int(10 * ratio), oracles)
                # the oracles first: their records take `s4r`'s bytes before it asks
                rows += [answer(fork, sample, index, name, ratio, args.length, budget, s4r)
                         for name, fork in forks.items()]
                if "s4r" in methods:
                    rows.append(answer(s4r, sample, index, "s4r", ratio, args.length, budget, s4r))
            records += rows
            note(f"{task} #{index}: " + ", ".join(f"{r.method}@{r.ratio:g} {r.score:.0f}" for r in rows))
    note.finish(args.json, {"accuracy": {"samples": [asdict(r) for r in records]},
                            "settings": vars(args)})


if __name__ == "__main__":
    main()
