"""Two documents in one chat: does the second, appended through the compressed cache, keep its needles?

    python -m s4r.bench.two_documents --samples 8 --length 2048 --book romeo-and-juliet

Per sample pair, document 1 (a needle sample) is prefilled once, forked into the full cache and into
S4R with each variant, and document 2 (another needle sample, another passage or `--second-book`) is
appended to every fork as `/read` does. Then, in each fork: the answer NLL of each document's needle
(teacher-forced, cache truncated back, see `s4r.bench.tuning.answer_nll`), and two greedy questions in
a row, document 1's then document 2's, scored as the bench scores them. Gaps to the full cache are
paired per sample.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from s4r.bench.intervals import mean_interval
from s4r.bench.scoring import score
from s4r.bench.tasks import answer_budget, make_samples
from s4r.bench.tuning import answer_nll, paired_gap
from s4r.session import Session

# what a second document's storage is compared with: bases of its own (the default) or folded into the
# first document's (round 3)
VARIANTS: dict[str, dict[str, Any]] = {
    "segments": {},
    "fold": {"segment_tokens": 0},
    # the round 3-5 default (`s4r-fast`: post-RoPE keys), with segments
    "fast-segments": {"key_space": "post_rope", "outlier_fraction": 0.03, "recon_cap": 1.0, "key_share": 0.5},
    # round 7: is document 1 lost in what is stored or in which tokens are rebuilt?
    "segments-recon1": {"recon_fraction": 1.0},
    # round 8: the fixed share of rounds 6-7 (the default now grows it where attention is flat)
    "segments-fixed": {"recon_drop": None},
}


@dataclass
class ArmResult:
    """One arm (full, or S4R with a variant) over every sample pair."""

    name: str
    overrides: dict[str, Any]
    nll: tuple[list[float], list[float]] = field(default_factory=lambda: ([], []))
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
                arm.nll[d].append(answer_nll(fork, sample))
            for d, sample in enumerate((doc1, doc2)):  # two questions in a row, as a chat asks them
                budget = answer_budget(sample, count, 32)
                answer, _ = fork.ask(sample.question, prime=sample.answer_prefix, max_new_tokens=budget)
                arm.scores[d].append(float(score(sample, answer)))
                arm.answers[d].append(answer)
        if note is not None:
            note(f"pair {k + 1}: " + ", ".join(
                f"{n} nll {a.nll[0][-1]:.3f}/{a.nll[1][-1]:.3f} "
                f"score {a.scores[0][-1]:.0f}/{a.scores[1][-1]:.0f}" for n, a in arms.items()))
            # what a wrong answer says (the other document's number, a digit dropped) is the diagnosis
            note(f"  needles {doc1.answers} / {doc2.answers}; answers " + ", ".join(
                f"{n} {a.answers[0][-1].strip()!r} / {a.answers[1][-1].strip()!r}" for n, a in arms.items()))
    return arms


def summary(arms: dict[str, ArmResult]) -> dict[str, Any]:
    """Per arm and document: mean score [95%], answer-NLL gap to full [paired 95%], n; mean ratio."""
    full = arms["full"]
    out = {}
    for name, arm in arms.items():
        docs = []
        for d in (0, 1):
            gap = paired_gap(arm.nll[d], full.nll[d])
            acc = mean_interval(arm.scores[d])
            docs.append({"score": acc.mean, "score_low": acc.low, "score_high": acc.high, "samples": acc.n,
                         "nll_gap": gap.mean, "nll_gap_low": gap.low, "nll_gap_high": gap.high})
        out[name] = {"documents": docs, "ratio": sum(arm.ratio) / len(arm.ratio), "raw": asdict(arm)}
    return out


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m s4r.bench.two_documents [--samples 8] [--length 2048] [--ratio 5] [--book B]
    [--second-book B] [--variants segments,fold] [--json PATH]`."""
    import argparse

    from s4r.bench.haystack import HELDOUT_BOOK
    from s4r.loading import load_model

    parser = argparse.ArgumentParser(prog="python -m s4r.bench.two_documents", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--length", type=int, default=2048, help="tokens of each document")
    parser.add_argument("--samples", type=int, default=8, help="document pairs")
    parser.add_argument("--ratio", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--book", default=HELDOUT_BOOK, help="haystack of document 1 (default: held out)")
    parser.add_argument("--second-book", default=None, help="haystack of document 2 (default: --book)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS)}")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    names = [n for n in args.variants.split(",") if n]
    if unknown := [n for n in names if n not in VARIANTS]:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    loaded = load_model(args.model)
    t0 = time.perf_counter()

    def note(message: str) -> None:
        print(f"[{time.perf_counter() - t0:.0f} s] {message}", flush=True)

    arms = run_pairs(loaded, {n: VARIANTS[n] for n in names}, length=args.length, samples=args.samples,
                     ratio=args.ratio, book=args.book, second_book=args.second_book or args.book,
                     seed=args.seed, note=note)
    result = summary(arms)
    for name, res in result.items():
        cells = [f"doc {d + 1}: score {doc['score']:.0f} [{doc['score_low']:.0f}-{doc['score_high']:.0f}] "
                 f"NLL gap {doc['nll_gap']:+.3f} [{doc['nll_gap_low']:+.3f}, {doc['nll_gap_high']:+.3f}]"
                 for d, doc in enumerate(res["documents"])]
        n = res["documents"][0]["samples"]
        print(f"{name:10s} x{res['ratio']:.2f}  " + "  |  ".join(cells) + f"  n={n}")
    print(f"wall {time.perf_counter() - t0:.0f} s")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "arms": result}, f, indent=1)


if __name__ == "__main__":
    main()
