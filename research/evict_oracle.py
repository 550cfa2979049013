"""Would evicting first buy S4R's answers back past 5x? Survivors of a query-agnostic eviction, stored by S4R.

    python -m research.evict_oracle --ratios 8,10 --keep 0.75,0.625,0.5 --samples 10 \
        --tasks niah_multivalue,niah_multiquery --json out.json

Every sample is prefilled once, exactly, scored by KVzip's context reconstruction (`s4r.methods.kvzip`,
a token's score its largest over the KV heads: an S4R layer's basis spans every head, so every head keeps
the same tokens), and answered greedily by:
- `full`, `s4r@R`, `stored@R`: as in `research.coding_oracle` (`stored`: every token `s4r@R` stores,
  rebuilt, read by exact attention);
- `evictF@R`: the `F` share of the non-sink tokens KVzip scores best (the chat template's head and the
  sinks always kept), each as `s4r` stores it at the bytes that leave (every token stored at a lower
  ratio, then the evicted ones dropped), read by exact attention over the survivors at their own
  positions. Its bytes are charged as such a store would hold them: the layer's fixed part (sinks,
  bases, buffer) once, the per-token part (coefficients, bands, scales, outliers) for the survivors
  only, and a bit per token for which survived; the ratio is chosen so that this comes to what
  `s4r@R` achieves (its budget reserves the buffer of new tokens at its cap, so a 4k-token store
  ingested at 8x achieves more), and the achieved figure is recorded.

This is an oracle of the store, not the method: the bases are fitted on every token, and nothing selects.
Against `stored@R` it says what the survivors' extra bits buy net of what the evicted tokens take away.
The JSON is `s4r bench --json`'s accuracy record (`research.merge_runs` tabulates paired gaps).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from research.coding_oracle import oracle_forks
from research.progress import ElapsedLog, measuring_parser
from research.tuning import AnswerFit, answer_fit, paired_gap
from s4r.bench.tasks import TUNING_BOOK, make_samples
from s4r.core.compress import compressible_parts
from s4r.core.subspace import relative_residual
from s4r.layers.eviction import EvictedLayer
from s4r.layers.full import tensor_bytes
from s4r.methods.base import CompressContext
from s4r.methods.kvzip import KVzipMethod
from s4r.methods.scorer import keep_top, protect_first
from s4r.runtime.session import Session


def token_scores(staged: Session) -> tuple[list[torch.Tensor], int]:
    """Per layer [T]: each token's KVzip score, the largest over its KV heads; and how many first tokens
    (sinks, the chat template's head) are always kept."""
    method = KVzipMethod()
    ctx = CompressContext(rope=staged.rope, ratio=1.0, model=staged.model, tokenizer=staged.tokenizer,
                          ids=staged._staged_ids)
    method.prepare(staged.cache, ctx)
    return [s.amax(dim=0) for s in method._scores], method._protect


def per_token_bytes(layer) -> int:
    """The bytes of an S4R layer that scale with its stored tokens: coefficients, bands, their scales and
    steps, the outliers (indices and exact rows)."""
    outliers = tensor_bytes(layer.out_idx, layer.out_k, layer.out_v)
    return outliers + tensor_bytes(layer.coef_k, layer.coef_v, layer.scale_k, layer.scale_v, layer.tail_k,
                                   layer.tail_v, layer.tail_step_k, layer.tail_step_v)


def evicted_bytes(s4r: Session, keep: float) -> int:
    """What `s4r`'s store would hold with only `keep` of its tokens (and a bit per token saying which)."""
    total = 0
    for layer in s4r.cache.layers:
        variable = per_token_bytes(layer)
        total += layer.nbytes() - variable + round(keep * variable) + (layer.logical + 7) // 8
    return total


def store_for(staged: Session, target: float, keep: float, guess: float) -> tuple[Session, float]:
    """An `s4r` fork whose store, cut to `keep` of its tokens, comes to about 1/target of the full cache
    (the fork's ratio from `guess`, corrected twice); and that store's achieved ratio."""
    full = staged.memory().full_bytes
    for _ in range(3):
        fork = staged.fork(method="s4r", ratio=guess)
        achieved = full / evicted_bytes(fork, keep)
        if abs(achieved / target - 1) < 0.01:
            break
        guess *= target / achieved
    return fork, achieved


def residual_scores(staged: Session, s4r: Session) -> list[torch.Tensor]:
    """Per layer [T - sinks]: each non-sink token's relative residual off `s4r`'s key and value bases
    (summed), the measure s4r picks its outliers by."""
    out = []
    for layer, staged_layer in zip(s4r.cache.layers, staged.cache.layers, strict=True):
        keys, values = staged_layer.keys_view[0], staged_layer.values_view[0]
        pre_k, pre_v = compressible_parts(keys, values, layer.cfg, staged.rope)
        unit = [torch.linalg.qr(b.float())[0] for b in (layer.basis_k, layer.basis_v)]
        out.append(relative_residual(pre_k, unit[0]) + relative_residual(pre_v, unit[1]))
    return out


def evicted_copy(staged: Session, s4r: Session, scores: list[torch.Tensor], protect: int,
                 keep: float, residuals: list[torch.Tensor] | None = None,
                 protect_share: float = 0.0) -> Session:
    """A fork of `staged` holding, per layer, the sinks and the `keep` share of the other tokens scored
    best, those as `s4r` stores them (rebuilt), at their own positions. With `residuals`, the
    `protect_share` of the non-sink tokens with the largest residual are kept whatever they score."""
    stored = oracle_forks(staged, s4r, 0, ("stored",))["stored"]
    for i, layer in enumerate(stored.cache.layers):
        keys, values = layer.keys_view[0], layer.values_view[0]  # [H, T, d]
        total, sinks = keys.shape[1], s4r.cache.layers[i].sinks
        budget = sinks + round(keep * (total - sinks))
        score = protect_first(scores[i], max(protect, sinks), budget)
        if residuals is not None and protect_share > 0:
            worst = torch.topk(residuals[i], round(protect_share * (total - sinks))).indices
            score[sinks + worst] = float("inf")
        idx = keep_top(score, budget)
        stored.cache.layers[i] = EvictedLayer(keys[:, idx].contiguous(), values[:, idx].contiguous(), total)
    return stored


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m research.evict_oracle [--ratios 8,10] [--keep 0.75,0.625,0.5] [--samples 10] ...`."""
    from s4r.models.loading import load_model

    parser = measuring_parser("python -m research.evict_oracle", __doc__, length=4096, book=TUNING_BOOK)
    parser.add_argument("--ratios", default="8,10")
    parser.add_argument("--keep", default="0.75,0.625,0.5", help="shares of the non-sink tokens kept")
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--tasks", default="niah_multivalue,niah_multiquery")
    parser.add_argument("--protect", default="0", help="shares of the tokens kept for their residual")
    args = parser.parse_args(argv)
    ratios = [float(r) for r in args.ratios.split(",") if r]
    keeps = [float(k) for k in args.keep.split(",") if k]
    protects = [float(p) for p in args.protect.split(",") if p]
    loaded = load_model(args.model)
    tok = loaded.tokenizer

    def count(s: str) -> int:
        return len(tok.encode(s, add_special_tokens=False))

    note = ElapsedLog()
    fits: dict[str, list[AnswerFit]] = {}
    ratios_of: dict[str, list[float]] = {}
    for task in [t for t in args.tasks.split(",") if t]:
        for k, sample in enumerate(make_samples(task, args.length, args.samples, args.seed, count,
                                                book=args.book)):
            staged = Session(loaded, method="full")
            staged.ingest(sample.context, compress=False)
            scores, protect = token_scores(staged)
            rows = {"full": (answer_fit(staged.fork(method="full", ratio=1.0), sample), 1.0)}
            for ratio in ratios:
                s4r = staged.fork(method="s4r", ratio=ratio)
                target = s4r.memory().ratio
                stored = oracle_forks(staged, s4r, 0, ("stored",))["stored"]
                rows[f"stored@{ratio:g}"] = (answer_fit(stored, sample), target)
                rows[f"s4r@{ratio:g}"] = (answer_fit(s4r, sample), target)
                for keep in keeps:
                    fork, achieved = store_for(staged, target, keep, ratio * keep)
                    residuals = residual_scores(staged, fork) if any(protects) else None
                    for share in protects:
                        session = evicted_copy(staged, fork, scores, protect, keep, residuals, share)
                        name = f"evict{keep:g}" + (f"r{share:g}" if share else "")
                        rows[f"{name}@{ratio:g}"] = (answer_fit(session, sample), achieved)
            for name, (fit, achieved) in rows.items():
                fits.setdefault(name, []).append(fit)
                ratios_of.setdefault(name, []).append(achieved)
            note(f"{task} #{k}: " + ", ".join(f"{n} {f.nll:.3f}/{f.margin:+.1f} ({a:.2f}x)"
                                              for n, (f, a) in rows.items()))
    nll = {name: [f.nll for f in values] for name, values in fits.items()}
    for name, values in fits.items():
        at = name.partition("@")[2]
        refs = ["full"] + ([f"stored@{at}", f"s4r@{at}"] if name.startswith("evict") else [])
        gaps = [paired_gap(nll[name], nll[ref]) for ref in refs]
        positive = sum(f.margin > 0 for f in values)
        note(f"{name}: {sum(ratios_of[name]) / len(values):.2f}x, margins positive {positive}/{len(values)}, "
             + ", ".join(f"vs {r} {g.mean:+.3f} [{g.low:+.3f}, {g.high:+.3f}]"
                         for r, g in zip(refs, gaps, strict=True)))
    note.finish(args.json, {"nll": nll, "margin": {n: [f.margin for f in v] for n, v in fits.items()},
                            "ratio": ratios_of, "settings": vars(args)})


if __name__ == "__main__":
    main()
