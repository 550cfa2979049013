"""Two documents in one chat: does the second, appended through the compressed cache, keep its needles?

    python -m research.two_documents --samples 8 --length 2048 --book romeo-and-juliet

Per sample pair, document 1 (a needle sample) is prefilled once, forked into the full cache and into
S4R with each variant, and document 2 (another needle sample, another passage or `--second-book`) is
appended to every fork as `/read` does. Then, in each fork:
- the answer NLL and greedy margin of each document's needle (teacher-forced, cache truncated back, see
  `research.tuning.answer_fit`);
- the chat margin: document 2's, after document 1's question was asked and answered with its reference
  (the number a copy would wrongly repeat is then in the conversation);
- two greedy questions in a row, document 1's then document 2's, scored as the bench scores them.
Gaps to the full cache are paired per sample. A margin above 0 means greedy decoding copies the answer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from research.progress import ElapsedLog, chosen_variants, measuring_parser
from research.tuning import AnswerFit, answer_fit, paired_gap
from s4r.bench.intervals import mean_interval
from s4r.bench.scoring import score
from s4r.bench.tasks import Sample, answer_budget, make_samples
from s4r.runtime.session import Session

# what a second document's storage is compared with: bases of its own (the default) or folded into the
# first document's
VARIANTS: dict[str, dict[str, Any]] = {
    "segments": {},
    # each segment keeps 1/ratio of its own tokens with bases of its own (the default shares the layer's
    # budget, and document 2's bases extend document 1's)
    "segments-own-budget": {"segment_budget": "segment", "segment_bases": "own"},
    # the layer's budget, but bases of its own
    "own-bases": {"segment_bases": "own"},
    "fold": {"segment_tokens": 0},
    # blocks of queries (document 2's blocks, the questions' prompts) through the selection instead of
    # attending every stored token
    "selected-blocks": {"dense_queries": 0},
    # `s4r-fast` (post-RoPE keys), with segments
    "fast-segments": {"key_space": "post_rope", "outlier_fraction": 0.03, "recon_cap": 1.0, "key_share": 0.5},
    # is document 1 lost in what is stored or in which tokens are rebuilt?
    "segments-recon1": {"recon_fraction": 1.0},
    # a fixed rebuilt share (the default grows it where attention is flat)
    "segments-fixed": {"recon_drop": None},
    # where document 2's copies are lost: An oracle storing every token losslessly (it ignores
    # the ratio), and more exact outliers
    "oracle-lossless": {"rank_k": 192, "rank_v": 192, "coef_dtype": "model", "outlier_fraction": 0.0},
    "out0.03": {"outlier_fraction": 0.03},
    "out0.05": {"outlier_fraction": 0.05},
    # is it the chat turn folded into document 2's bases? a buffer that keeps it exact
    "buffer128": {"buffer_tokens": 128},
    "buffer256": {"buffer_tokens": 256},
    # document 2's bases extend document 1's (stored once; the default)
    "extend": {"segment_bases": "extend"},
    # which kind document 2's copies lean on: more rank to the keys or to the values (both documents)
    "ks0.5": {"key_share": 0.5},
    "ks0.3": {"key_share": 0.3},
}


@dataclass
class ArmResult:
    """One arm (full, or S4R with a variant) over every sample pair."""

    name: str
    overrides: dict[str, Any]
    nll: tuple[list[float], list[float]] = field(default_factory=lambda: ([], []))
    margin: tuple[list[float], list[float]] = field(default_factory=lambda: ([], []))
    chat_margin: list[float] = field(default_factory=list)  # document 2's, after document 1's Q and A
    scores: tuple[list[float], list[float]] = field(default_factory=lambda: ([], []))
    answers: tuple[list[str], list[str]] = field(default_factory=lambda: ([], []))  # the greedy ones
    ratio: list[float] = field(default_factory=list)


def run_pairs(loaded: Any, variants: dict[str, dict[str, Any]], *, length: int, samples: int, ratio: float,
              book: str, second_book: str, task: str = "niah_single_book", seed: int = 0,
              note: Callable[[str], None] | None = None) -> dict[str, ArmResult]:
    """Every arm's needle NLLs and greedy scores per document (see the module docstring)."""
    tok = loaded.tokenizer

    def count(s: str) -> int:
        return len(tok.encode(s, add_special_tokens=False))

    firsts = make_samples(task, length, samples, seed, count, book=book)
    # another seed stream: another passage and needle, even from the same book
    seconds = make_samples(task, length, samples, seed + 1, count, book=second_book)
    arms = {"full": ArmResult("full", {})}
    arms.update({name: ArmResult(name, ov) for name, ov in variants.items()})
    for k, (doc1, doc2) in enumerate(zip(firsts, seconds, strict=True)):
        staged = Session(loaded, method="full")
        staged.ingest(doc1.context, compress=False)
        for name, arm in arms.items():
            fork = (staged.fork(method="full", ratio=1.0) if name == "full" else
                    staged.fork(method="s4r", ratio=ratio, config_overrides=arm.overrides))
            fork.ingest(doc2.context)
            arm.ratio.append(fork.memory().ratio)
            for d, sample in enumerate((doc1, doc2)):
                fit = answer_fit(fork, sample)
                arm.nll[d].append(fit.nll)
                arm.margin[d].append(fit.margin)
            arm.chat_margin.append(chat_fit(fork, doc1, doc2).margin)
            for d, sample in enumerate((doc1, doc2)):  # two questions in a row, as a chat asks them
                budget = answer_budget(sample, count, 32)
                answer, _ = fork.ask(sample.question, prime=sample.answer_prefix, max_new_tokens=budget)
                arm.scores[d].append(float(score(sample, answer)))
                arm.answers[d].append(answer)
        if note is not None:
            note(f"pair {k + 1}: " + ", ".join(
                f"{n} nll {a.nll[0][-1]:.3f}/{a.nll[1][-1]:.3f} "
                f"margin {a.margin[0][-1]:+.2f}/{a.margin[1][-1]:+.2f} chat {a.chat_margin[-1]:+.2f} "
                f"score {a.scores[0][-1]:.0f}/{a.scores[1][-1]:.0f}" for n, a in arms.items()))
            # what a wrong answer says (the other document's number, a digit dropped) is the diagnosis
            note(f"  needles {doc1.answers} / {doc2.answers}; answers " + ", ".join(
                f"{n} {a.answers[0][-1].strip()!r} / {a.answers[1][-1].strip()!r}" for n, a in arms.items()))
    return arms


def chat_fit(session: Session, asked: Sample, sample: Sample) -> AnswerFit:
    """`answer_fit` of `sample` after `asked` was asked and answered with its reference answer (teacher-
    forced, as a chat turn); the session is cleared back to its documents afterwards."""
    session.ask(asked.question, prime=f"{asked.answer_prefix} {', '.join(asked.answers)}.", max_new_tokens=0)
    fit = answer_fit(session, sample)
    session.clear()
    return fit


def _margin_cells(values: list[float], reference: list[float], prefix: str) -> dict[str, float]:
    """Mean margin, share of positive margins (greedy copies) and the paired gap to the reference."""
    gap = paired_gap(values, reference)
    n = len(values)
    return {prefix: sum(values) / n, f"{prefix}_positive": sum(v > 0 for v in values) / n,
            f"{prefix}_gap": gap.mean, f"{prefix}_gap_low": gap.low, f"{prefix}_gap_high": gap.high}


def summary(arms: dict[str, ArmResult]) -> dict[str, Any]:
    """Per arm and document: mean score [95%], answer-NLL and margin gaps to full [paired 95%], n; document
    2's chat margin; mean ratio."""
    full = arms["full"]
    out = {}
    for name, arm in arms.items():
        docs = []
        for d in (0, 1):
            gap = paired_gap(arm.nll[d], full.nll[d])
            acc = mean_interval(arm.scores[d])
            docs.append({"score": acc.mean, "score_low": acc.low, "score_high": acc.high, "samples": acc.n,
                         "nll_gap": gap.mean, "nll_gap_low": gap.low, "nll_gap_high": gap.high,
                         **_margin_cells(arm.margin[d], full.margin[d], "margin")})
        docs[1].update(_margin_cells(arm.chat_margin, full.chat_margin, "chat_margin"))
        out[name] = {"documents": docs, "ratio": sum(arm.ratio) / len(arm.ratio), "raw": asdict(arm)}
    return out


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m research.two_documents [--samples 8] [--length 2048] [--ratio 5] [--book B]
    [--second-book B] [--variants segments,fold] [--json PATH]`."""
    from s4r.bench.haystack import HELDOUT_BOOK
    from s4r.models.loading import load_model

    parser = measuring_parser("python -m research.two_documents", __doc__, length=2048, book=HELDOUT_BOOK,
                              length_help="tokens of each document",
                              book_help="haystack of document 1 (default: held out)")
    parser.add_argument("--samples", type=int, default=8, help="document pairs")
    parser.add_argument("--ratio", type=float, default=5.0)
    parser.add_argument("--second-book", default=None, help="haystack of document 2 (default: --book)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS)}")
    args = parser.parse_args(argv)
    variants = chosen_variants(parser, args.variants, VARIANTS)
    loaded = load_model(args.model)
    note = ElapsedLog()
    arms = run_pairs(loaded, variants, length=args.length, samples=args.samples,
                     ratio=args.ratio, book=args.book, second_book=args.second_book or args.book,
                     seed=args.seed, note=note)
    result = summary(arms)
    for name, res in result.items():
        cells = [f"doc {d + 1}: score {doc['score']:.0f} [{doc['score_low']:.0f}-{doc['score_high']:.0f}] "
                 f"NLL gap {doc['nll_gap']:+.3f} [{doc['nll_gap_low']:+.3f}, {doc['nll_gap_high']:+.3f}] "
                 f"margin {doc['margin']:+.2f} ({doc['margin_positive']:.0%} > 0)"
                 for d, doc in enumerate(res["documents"])]
        doc2 = res["documents"][1]
        cells.append(f"chat margin {doc2['chat_margin']:+.2f} ({doc2['chat_margin_positive']:.0%} > 0), "
                     f"gap {doc2['chat_margin_gap']:+.2f} [{doc2['chat_margin_gap_low']:+.2f}, "
                     f"{doc2['chat_margin_gap_high']:+.2f}]")
        n = res["documents"][0]["samples"]
        print(f"{name:10s} x{res['ratio']:.2f}  " + "  |  ".join(cells) + f"  n={n}")
    note.finish(args.json, {"args": vars(args), "arms": result})


if __name__ == "__main__":
    main()
