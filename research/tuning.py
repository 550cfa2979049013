"""Tuning runs: S4R settings compared by the likelihood of the reference answer, on the tuning book.

Greedy answers score 0 or 100 and need many samples to separate two settings; the negative
log-likelihood of the reference answer (teacher-forced after the question and the answer prefix, one
answer token per step as generation feeds it) is a continuous figure, so variants can be told apart with
a few samples. Every
sample is prefilled once and forked into every variant (as the bench does). The gap to the full cache
is paired per sample, so its interval leaves the samples' own difficulty out.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from research.progress import ElapsedLog, chosen_variants, measuring_parser
from s4r.bench.intervals import Interval, difference_interval
from s4r.bench.tasks import TUNING_BOOK, Sample, make_samples
from s4r.errors import BudgetError
from s4r.runtime.session import Session


@dataclass(frozen=True)
class AnswerFit:
    """How well a cache predicts a sample's reference answer, teacher-forced after its question.

    nll: mean negative log-likelihood per answer token (nats); margin: the smallest, over the answer's
    tokens before its closing full stop, of the reference token's log-probability minus the best other
    token's. Greedy decoding copies the reference exactly when every such margin is positive, so the
    margin is a continuous stand-in for a 0/100 greedy score (a dropped digit or the other document's
    number shows as a negative margin while the mean NLL barely moves).
    """

    nll: float
    margin: float


def answer_fit(session: Session, sample: Sample, stepwise: bool = True) -> AnswerFit:
    """NLL and greedy margin (`AnswerFit`) of the sample's reference answer after its question, through
    the session's cache; the cache is truncated back afterwards, so the session can be reused.

    `stepwise`: the question goes in as one chunk and the answer one token at a time, as generation
    feeds it (a compressed cache chooses the tokens it rebuilds per step, so a chunk of answer rows
    sharing one choice measures another thing); False: question and answer in one teacher-forced chunk.
    """
    prompt = session._encode(session._turn_prefix() + sample.question.strip() + session.segments.to_assistant
                             + sample.answer_prefix)
    answer = session._encode(" " + ", ".join(sample.answers) + ".")
    start = session.logical_length
    chunks = [prompt, *([t] for t in answer[:-1])] if stepwise else [prompt + answer[:-1]]
    keep = 1 if stepwise else len(answer)  # logits of the rows that predict answer tokens
    logits, pos = [], start
    with torch.inference_mode():
        for chunk in chunks:
            ids = torch.tensor([chunk], dtype=torch.long, device=session.device)
            positions = torch.arange(pos, pos + len(chunk), device=ids.device).unsqueeze(0)
            out = session.model(input_ids=ids, position_ids=positions, cache=session.cache, use_cache=True,
                                logits_to_keep=keep)
            logits.append(out.logits[0].float())
            pos += len(chunk)
        logp = torch.log_softmax(torch.cat(logits), dim=-1)
        target = torch.tensor(answer, device=logp.device).unsqueeze(1)
        right = logp.gather(1, target)[:, 0]
        nll = -right.mean().item()
        # the full stop is left out of the margin: an answer that goes on after the number still scores
        body = max(1, len(answer) - 1)
        rivals = logp[:body].scatter(1, target[:body], float("-inf")).amax(dim=-1)
        margin = (right[:body] - rivals).min().item()
    session.cache.truncate(start)
    return AnswerFit(nll, margin)


def answer_nll(session: Session, sample: Sample, stepwise: bool = True) -> float:
    """Mean NLL (nats per token) of the sample's reference answer after its question (see `answer_fit`)."""
    return answer_fit(session, sample, stepwise).nll


@dataclass
class VariantResult:
    """Answer NLLs of one variant, sample by sample (the same samples for every variant)."""

    name: str
    overrides: dict[str, Any]
    nll: list[float] = field(default_factory=list)
    margin: list[float] = field(default_factory=list)  # greedy margins (`AnswerFit.margin`)
    ratio: list[float] = field(default_factory=list)
    compress_seconds: list[float] = field(default_factory=list)
    rebuilt: list[float] = field(default_factory=list)  # share of the stored tokens the answer rebuilt

    def gap(self, reference: VariantResult) -> Interval:
        """Mean of the per-sample NLL gaps to `reference` (the full cache, or another variant), with a
        paired t interval (nats, not 0-100)."""
        return paired_gap(self.nll, reference.nll)


def paired_gap(values: Sequence[float], reference: Sequence[float]) -> Interval:
    """Mean of the per-sample differences `values - reference` (NLLs of the same samples), with a paired t
    interval (nats, not 0-100)."""
    return difference_interval([a - b for a, b in zip(values, reference, strict=True)])


def compare_variants(loaded: Any, variants: dict[str, dict[str, Any]], *, tasks: Sequence[str], length: int,
                     samples: int, ratio: float = 5.0, book: str = TUNING_BOOK, seed: int = 0,
                     method: str = "s4r",
                     note: Callable[[str], None] | None = None) -> dict[str, VariantResult]:
    """Answer NLL of the full cache (key "full") and of `method` at `ratio` with each variant's
    overrides, over `samples` samples of each task at `length` tokens of `book`."""
    tok = loaded.tokenizer

    def count(s: str) -> int:
        return len(tok.encode(s, add_special_tokens=False))

    results = {"full": VariantResult("full", {})}
    results.update({name: VariantResult(name, ov) for name, ov in variants.items()})
    for task in tasks:
        for k, sample in enumerate(make_samples(task, length, samples, seed, count, book=book)):
            staged = Session(loaded, method="full")
            staged.ingest(sample.context, compress=False)
            for name, res in results.items():
                t0 = time.perf_counter()
                try:
                    fork = (staged.fork(method="full", ratio=1.0) if name == "full" else
                            staged.fork(method=method, ratio=ratio, config_overrides=res.overrides))
                except BudgetError:  # a variant that cannot reach the ratio (too many exact outliers)
                    res.compress_seconds.append(math.nan)
                    res.ratio.append(math.nan)
                    res.nll.append(math.nan)
                    res.margin.append(math.nan)
                    res.rebuilt.append(math.nan)
                    continue
                res.compress_seconds.append(time.perf_counter() - t0)
                res.ratio.append(fork.memory().ratio)
                fit = answer_fit(fork, sample)
                res.nll.append(fit.nll)
                res.margin.append(fit.margin)
                share = fork.cache.rebuilt_share()
                res.rebuilt.append(math.nan if share is None else share)
            if note is not None:
                note(f"{task} #{k + 1}: " + ", ".join(f"{n} {r.nll[-1]:.3f} ({r.margin[-1]:+.2f})"
                                                     for n, r in results.items()))
    return results


# storage and decode variants of the ratio-5 default, each a set of S4RConfig overrides; docs/design.md
# says which of them chose a default and why
TUNING_VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "int8+out0.05": {"coef_bands": None, "outlier_fraction": 0.05},  # plain int8
    "int8+out0.15": {"coef_bands": None, "outlier_fraction": 0.15},
    "bands134+out0.02": {"coef_bands": "8:1,4:3,2:4", "outlier_fraction": 0.02},
    "bands134+out0.05": {"coef_bands": "8:1,4:3,2:4", "outlier_fraction": 0.05},
    "bands134+out0.10": {"coef_bands": "8:1,4:3,2:4", "outlier_fraction": 0.10},
    "bands233+out0.03": {"coef_bands": "8:2,4:3,2:3", "outlier_fraction": 0.03},
    "bands233+out0.06": {"coef_bands": "8:2,4:3,2:3", "outlier_fraction": 0.06},
    "bands233+out0.08": {"coef_bands": "8:2,4:3,2:3", "outlier_fraction": 0.08},
    "attn-outliers": {"outlier_score": "attention"},
    "key_share=0.35": {"key_share": 0.35},
    "key_share=0.65": {"key_share": 0.65},
    "energy-ranks": {"rank_alloc": "energy"},
    "outliers=0": {"outlier_fraction": 0.0},
    "outliers=0.10": {"outlier_fraction": 0.10},
    "outliers=0.12": {"outlier_fraction": 0.12},
    "outliers=0.15": {"outlier_fraction": 0.15},
    "outliers=0.10+ks0.65": {"outlier_fraction": 0.10, "key_share": 0.65},
    # the key space: post-RoPE as `s4r-fast` stores it, pre-RoPE with several outlier shares
    "post-rope": {"key_space": "post_rope", "outlier_fraction": 0.03, "key_share": 0.5},
    "pre-rope": {"key_space": "pre_rope", "outlier_fraction": 0.03},
    "pre-rope+out0": {"key_space": "pre_rope", "outlier_fraction": 0.0},
    "pre-rope+out0.01": {"key_space": "pre_rope", "outlier_fraction": 0.01},
    "pre-rope+out0.01+recon0.1": {"key_space": "pre_rope", "outlier_fraction": 0.01, "recon_fraction": 0.1},
    "pre-rope+out0.01+recon0.15": {"key_space": "pre_rope", "outlier_fraction": 0.01, "recon_fraction": 0.15},
    "pre-rope+out0.01+recon0.2": {"key_space": "pre_rope", "outlier_fraction": 0.01, "recon_fraction": 0.2},
    "pre-rope+out0.01+recon0.3": {"key_space": "pre_rope", "outlier_fraction": 0.01, "recon_fraction": 0.3},
    "pre-rope+expected": {"key_space": "pre_rope", "outlier_fraction": 0.03, "rope_scoring": "expected"},
    "pre-rope+out0.01+expected": {"key_space": "pre_rope", "outlier_fraction": 0.01,
                                  "rope_scoring": "expected"},
    "pre-rope+out0.01+expected512": {"key_space": "pre_rope", "outlier_fraction": 0.01,
                                     "rope_scoring": "expected", "rope_chunk": 512},
    "pre-rope+out0.01+expected1024": {"key_space": "pre_rope", "outlier_fraction": 0.01,
                                      "rope_scoring": "expected", "rope_chunk": 1024},
    "pre-rope+out0.01+expected256": {"key_space": "pre_rope", "outlier_fraction": 0.01,
                                     "rope_scoring": "expected", "rope_chunk": 256},
    "pre-rope+out0.01+expected512+recon0.2": {"key_space": "pre_rope", "outlier_fraction": 0.01,
                                              "rope_scoring": "expected", "rope_chunk": 512,
                                              "recon_fraction": 0.2},
    "pre-rope+out0.01+expected128": {"key_space": "pre_rope", "outlier_fraction": 0.01,
                                     "rope_scoring": "expected", "rope_chunk": 128},
    "pre-rope+recon1": {"key_space": "pre_rope", "outlier_fraction": 0.03, "recon_fraction": 1.0},
    "post-rope+recon1": {"key_space": "post_rope", "outlier_fraction": 0.03, "recon_fraction": 1.0,
                         "key_share": 0.5},
    # where multi-value answers are lost at ratio 5: oracles that
    # store one kind losslessly (model-dtype coefficients at full rank, no outliers); they ignore the ratio
    "recon1": {"recon_fraction": 1.0},
    "oracle-lossless": {"rank_k": 192, "rank_v": 192, "coef_dtype": "model", "outlier_fraction": 0.0},
    "oracle-v97": {"rank_k": 192, "rank_v": 97, "coef_dtype": "model", "outlier_fraction": 0.0},
    "oracle-k96": {"rank_k": 96, "rank_v": 192, "coef_dtype": "model", "outlier_fraction": 0.0},
    "oracle-int8bands": {"rank_k": 192, "rank_v": 192, "outlier_fraction": 0.0},
    # the oracles put the loss in the values' rank: move bytes from keys to values (0.4 is the default)
    "ks0.5": {"key_share": 0.5},
    "ks0.45": {"key_share": 0.45},
    "ks0.4": {"key_share": 0.4},
    "ks0.35": {"key_share": 0.35},
    "ks0.3": {"key_share": 0.3},
    # in fp32 at 5x the values reach the full width: ks0.25 then gives the keys half of it (96 of 192)
    "ks0.25": {"key_share": 0.25},
    # value coefficients score nothing: a narrower int8 lead buys them rank (value_bands)
    "ks0.4+v134": {"key_share": 0.4, "value_bands": "8:1,4:3,2:4"},
    "ks0.35+v134": {"key_share": 0.35, "value_bands": "8:1,4:3,2:4"},
    "ks0.4+v143": {"key_share": 0.4, "value_bands": "8:1,4:4,2:3"},
    "ks0.4+v17": {"key_share": 0.4, "value_bands": "8:1,4:7"},
    # is the multi-value and frequent-words loss the choice of tokens (recon_cap) or storage?
    "cap0.4": {"recon_cap": 0.4},  # at ratio 2.5: the paper's fraction 1/ratio
    "recon0.3": {"recon_fraction": 0.3},  # at ratio 5: more than 1/ratio
    "recon0.4": {"recon_fraction": 0.4},
    # once the rank is full (ratio 2.5 at 4k), richer bands instead of unused bytes
    "bands431": {"coef_bands": "8:4,4:3,2:1"},
    "bands-int8": {"coef_bands": None},
    # the choice itself: pooling, the rotation chunks of pre-RoPE scoring, memory of earlier queries
    "pool1": {"pool_kernel": 1},
    "pool3": {"pool_kernel": 3},
    "chunk128": {"rope_chunk": 128},
    "scoring-max": {"scoring": "max"},
    # an adaptive budget: more tokens while a query row would drop more than this much attention
    # (the default, up to 2/ratio); "fixed": a fixed share
    "fixed": {"recon_drop": None},
    # a step's rebuild capped in tokens: the adaptive budget's work grows with the context. The
    # default: 1,536 tokens at every ratio; "uncapped": no cap
    "uncapped": {"recon_token_cap": 0},
    "tokens1024": {"recon_token_cap": 1024},
    "tokens1536": {"recon_token_cap": 1536},
    "tokens2048": {"recon_token_cap": 2048},
    "tokens4096": {"recon_token_cap": 4096},
    "drop0.02+max0.4": {"recon_drop": 0.02, "recon_max": 0.4},
    "drop0.02": {"recon_drop": 0.02},
    "drop0.05": {"recon_drop": 0.05},
    "drop0.1": {"recon_drop": 0.1},
    "drop0.05+max1": {"recon_drop": 0.05, "recon_max": 1.0},
    "drop0.01": {"recon_drop": 0.01},
    "drop0.02+max1": {"recon_drop": 0.02, "recon_max": 1.0},
    "recon0.5": {"recon_fraction": 0.5},
    # the selected keys rebuilt by one int8 product (the default where the CPU has int8 dot products), in
    # the model's dtype, or in fp32
    "rebuild-model": {"rebuild_dtype": "model"},
    "rebuild-fp32": {"rebuild_dtype": "float32"},
    # the eager decode step, the reference the fused CPU kernels are tested against
    "eager": {"kernels": "eager"},
    # the question's prompt through one selection or every stored token (`dense_queries`); how many of its
    # last queries score the selection (`prompt_window`)
    "selected-prompts": {"dense_queries": 0}, "dense-prompts": {"dense_queries": 2},
    "prompt-window32": {"prompt_window": 32}, "prompt-window4": {"prompt_window": 4},
    # one basis per KV head instead of one per layer: a rebuild of heads-times fewer multiply-adds
    "head": {"granularity": "head"},
    # the conversation's opening (SmolLM2's default system prompt and template: 24 tokens) kept exact as
    # sinks: about half of the 1% outliers go to it (docs/design.md)
    "sinks24": {"sinks": 24},
    # past 5x (runs at --ratio 8 or 10), the presets' alternatives: values in the keys' bands as at 5x,
    # alone and with the rebuild budget shrunk with the ratio (2/R of the tokens, 10,240/R at most)
    "keys-bands": {"value_bands": "8:2,4:3,2:3"},
    "keys-bands-budget8": {"value_bands": "8:2,4:3,2:3", "recon_max": 0.25, "recon_token_cap": 1280},
    "keys-bands-budget10": {"value_bands": "8:2,4:3,2:3", "recon_max": 0.2, "recon_token_cap": 1024},
    # where the loss past 5x lies: every column stored exactly with the ratio's selection, or the ratio's
    # store with every token rebuilt (no selection)
    "exact-store": {"rank_k": 192, "rank_v": 192, "coef_dtype": "model", "outlier_fraction": 0.0},
    "rebuild-all": {"recon_fraction": 1.0, "recon_token_cap": 0},
    # is the sampled basis the loss? Bases fitted on every stored token (normalized, or raw: the L2-best
    # rank-r subspace), and that subspace at 8x's / 10x's bf16 ranks with exact coefficients (an upper
    # bound for any low-rank store of those ranks; it ignores the ratio)
    "svd-all": {"sample_tokens": None},
    "svd-all-raw": {"sample_tokens": None, "normalize": False},
    "lowrank-oracle8": {"rank_k": 49, "rank_v": 74, "coef_dtype": "model", "sample_tokens": None,
                        "outlier_fraction": 0.0},
    "lowrank-oracle10": {"rank_k": 34, "rank_v": 52, "coef_dtype": "model", "sample_tokens": None,
                         "outlier_fraction": 0.0},
    # the full-precision buffer of new tokens is counted full in the ratio (an eighth of the bytes at 8x):
    # a smaller one buys rank
    "buffer32": {"buffer_tokens": 32, "fold_tokens": 16},
    "buffer16": {"buffer_tokens": 16, "fold_tokens": 8},
    # the oracles put most of 8x's loss in the coefficients' bits: outliers' bytes to rank, other bands
    "out0+v17": {"outlier_fraction": 0.0, "value_bands": "8:1,4:7"},
    "out0+v134": {"outlier_fraction": 0.0, "value_bands": "8:1,4:3,2:4"},
    "out0+k134": {"outlier_fraction": 0.0, "coef_bands": "8:1,4:3,2:4"},
    "out0+k143": {"outlier_fraction": 0.0, "coef_bands": "8:1,4:4,2:3"},
    "out0+k332": {"outlier_fraction": 0.0, "coef_bands": "8:3,4:3,2:2"},
    "out0+k422": {"outlier_fraction": 0.0, "coef_bands": "8:4,4:2,2:2"},
    "out0+k8": {"outlier_fraction": 0.0, "coef_bands": None},
    # past 5x the values lose far more of their energy to the rank cut than the keys (14% vs 3% at 8x)
    "out0+ks0.35": {"outlier_fraction": 0.0, "key_share": 0.35},
    "out0+ks0.3": {"outlier_fraction": 0.0, "key_share": 0.3},
    # 8x's ranks fixed (bf16 at 4k), the earlier past-5x coding (values "8:1,2:7", no tail scaling): which
    # kind's low bits lose, keys' or values' (int8 throughout, "8:8")
    "fix8": {"rank_k": 49, "rank_v": 74, "value_bands": "8:1,2:7", "tail_norm": False},
    "fix8-k8": {"rank_k": 49, "rank_v": 74, "coef_bands": "8:8", "value_bands": "8:1,2:7",
                "tail_norm": False},
    "fix8-v8": {"rank_k": 49, "rank_v": 74, "value_bands": "8:8", "tail_norm": False},
    "fix8-kv8": {"rank_k": 49, "rank_v": 74, "coef_bands": "8:8", "value_bands": "8:8", "tail_norm": False},
    # past 5x: the earlier preset (values "8:1,2:7", keys 0.4 of the rank, orthonormal bases), each lower
    # band's columns in units of their RMS (`tail_norm`), wider 2-bit values at a 0.35 key share (the
    # preset is both), and 2-bit keys too
    "v-eighth": {"value_bands": "8:1,2:7", "key_share": 0.4, "tail_norm": False},
    "tailnorm": {"value_bands": "8:1,2:7", "key_share": 0.4, "tail_norm": True},
    "v2w": {"value_bands": "8:1,2:22", "key_share": 0.35, "tail_norm": False},
    "tailnorm+v2w": {"value_bands": "8:1,2:22", "key_share": 0.35, "tail_norm": True},
    "tailnorm+v2w+k2": {"tail_norm": True, "value_bands": "8:1,2:22", "coef_bands": "8:3,2:13",
                        "key_share": 0.46},
}


def perplexity_gaps(loaded: Any, variants: dict[str, dict[str, Any]], *, length: int, continuation: int,
                    ratio: float = 5.0, method: str = "s4r", book: str = TUNING_BOOK,
                    note: Callable[[str], None] | None = None) -> dict[str, tuple[float, float]]:
    """(mean NLL, achieved ratio) of a `continuation`-token continuation after `length` tokens of `book`
    (the tuning book unless told), read token by token through the full cache (key "full") and `method`
    with each variant; every variant is forked from one prefill and fed the continuation interleaved (as
    the bench does), so the gaps are paired."""
    from s4r.bench.perplexity import NLLMeter, token_nll
    from s4r.bench.scoring import perplexity_text
    from s4r.bench.speed import teacher_force

    tok = loaded.tokenizer
    context, text = perplexity_text(length, lambda s: len(tok.encode(s, add_special_tokens=False)),
                                    continuation_tokens=continuation, book=book)
    staged = Session(loaded, method="full")
    staged.ingest(context, compress=False)
    ids = tok.encode(text, add_special_tokens=False)[:continuation]
    names = ["full", *variants]
    forks = [staged.fork(method="full", ratio=1.0) if name == "full" else
             staged.fork(method=method, ratio=ratio, config_overrides=variants[name]) for name in names]
    meters = [NLLMeter() for _ in forks]

    def on_logits(j: int, i: int, logits: torch.Tensor) -> None:
        if i + 1 < len(ids):
            meters[j].add(token_nll(logits, ids[i + 1]))

    teacher_force(forks, ids, warmup=0, on_logits=on_logits)
    out = {name: (meter.mean, fork.memory().ratio)
           for name, meter, fork in zip(names, meters, forks, strict=True)}
    if note is not None:
        for name, (nll, _) in out.items():
            note(f"{name}: NLL {nll:.4f}, gap {nll - out['full'][0]:+.4f}")
    return out


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m research.tuning [--length 4096] [--samples 4] [--seed 0] [--variants a,b] [--json PATH]`:
    the tuning runs that choose S4R's defaults (needle tasks of the tuning book, answer NLL at ratio 5);
    with `--perplexity N`, the NLL gap of an N-token continuation after `--length` tokens instead."""
    from s4r.models.loading import load_model

    parser = measuring_parser("python -m research.tuning", main.__doc__, length=4096, book=TUNING_BOOK,
                              book_help="haystack and perplexity text (default: the tuning book)")
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--ratio", type=float, default=5.0)
    parser.add_argument("--tasks", default="niah_single_book,niah_multikey")
    parser.add_argument("--perplexity", type=int, default=0, metavar="N",
                        help="measure the NLL gap of an N-token continuation instead of answer NLLs")
    parser.add_argument("--variants", default=",".join(TUNING_VARIANTS), help="names of TUNING_VARIANTS")
    args = parser.parse_args(argv)
    variants = chosen_variants(parser, args.variants, TUNING_VARIANTS)
    loaded = load_model(args.model)
    note = ElapsedLog()

    if args.perplexity:
        gaps = perplexity_gaps(loaded, variants, length=args.length,
                               continuation=args.perplexity, ratio=args.ratio, book=args.book, note=note)
        note.finish(args.json, {n: {"nll": v[0], "gap": v[0] - gaps["full"][0], "ratio": v[1]}
                                for n, v in gaps.items()})
        return
    results = compare_variants(loaded, variants, tasks=args.tasks.split(","),
                               length=args.length, samples=args.samples, ratio=args.ratio, seed=args.seed,
                               book=args.book, note=note)
    full = results["full"]
    doc = {}
    for name, res in results.items():
        gap = res.gap(full)
        copies = sum(m > 0 for m in res.margin)
        doc[name] = {"overrides": res.overrides, "nll": res.nll, "gap": gap.mean, "gap_low": gap.low,
                     "gap_high": gap.high, "samples": gap.n, "margin": res.margin, "margin_positive": copies,
                     "ratio": sum(res.ratio) / len(res.ratio),
                     "compress_seconds": sum(res.compress_seconds) / len(res.compress_seconds),
                     "rebuilt": sum(res.rebuilt) / len(res.rebuilt) if res.rebuilt else math.nan}
        line = (f"{name:22s} answer NLL gap {gap.mean:+.3f} [{gap.low:+.3f}, {gap.high:+.3f}] n={gap.n}  "
                f"margin > 0: {copies}/{len(res.margin)}  "
                f"ratio {doc[name]['ratio']:.2f}  rebuilt {doc[name]['rebuilt']:.2f}  "
                f"compress {doc[name]['compress_seconds']:.1f} s")
        if "default" in results and name not in ("full", "default"):
            # a variant against the default is paired too, and far tighter than either gap to full
            vs = res.gap(results["default"])
            doc[name]["vs_default"] = {"gap": vs.mean, "gap_low": vs.low, "gap_high": vs.high}
            line += f"  vs default {vs.mean:+.3f} [{vs.low:+.3f}, {vs.high:+.3f}]"
        print(line)
    note.finish(args.json, doc)


if __name__ == "__main__":
    main()
