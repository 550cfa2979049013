"""A long chat over two documents: is the last question answered as well as the first?

    python -m research.long_chat --book romeo-and-juliet --pairs 12 --seed 50 --json out.json

Per pair: two documents of `--length` tokens, each with `--keys` needles (7-digit numbers for keys no
other needle of the pair shares, spread over the document). Document 1 is prefilled once and forked into
the full cache and S4R (each `--variants` entry); document 2 is added to every fork as `/read` adds it;
then every needle is asked for once, the documents taking turns (1, 2, 1, 2, ...), each greedy answer
staying in the conversation as a chat keeps it. So the later questions meet a cache that holds both
documents and a growing chat folded into the last segment. Reported per question position and for the
first and second half of the chat, each arm paired with the full cache on the same pairs, and the
achieved ratio after the last answer.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from research.progress import ElapsedLog, chosen_variants, measuring_parser
from research.tuning import paired_gap
from s4r.bench.haystack import HELDOUT_BOOK
from s4r.bench.intervals import mean_interval
from s4r.bench.needle_tasks import needle_keys, needle_question, quiz_document, random_numbers
from s4r.bench.sample import Sample
from s4r.bench.scoring import score
from s4r.bench.tasks import answer_budget
from s4r.runtime.session import Session

VARIANTS: dict[str, dict[str, Any]] = {
    "s4r": {},
    # the second document's bases fitted on it alone, not extending the first's
    "own-bases": {"segment_bases": "own"},
}


@dataclass
class ChatArm:
    """One arm (full, or S4R with a variant): per pair, the score of each question in chat order."""

    name: str
    overrides: dict[str, Any]
    scores: list[list[float]] = field(default_factory=list)
    answers: list[list[str]] = field(default_factory=list)
    ratio: list[float] = field(default_factory=list)  # after the last answer


def chat_questions(length: int, keys: int, seed: int, count_tokens: Callable[[str], int],
                   book: str) -> tuple[str, str, list[Sample]]:
    """(document 1, document 2, the questions in chat order): `keys` needles in each document, keys and
    numbers all distinct, the documents' questions taking turns."""
    rng = random.Random(f"s4r-bench:long-chat:{book}:{seed}")
    names = needle_keys(rng, 2 * keys)
    numbers = random_numbers(rng, 2 * keys)
    needles = [list(zip(names[d::2], numbers[d::2], strict=True)) for d in (0, 1)]
    docs = [quiz_document(n, book, length, rng, count_tokens) for n in needles]
    questions = []
    for i in range(keys):
        for d in (0, 1):
            key, number = needles[d][i]
            question, prefix = needle_question(key)
            questions.append(Sample("niah_single_book", docs[d], question, [number], "all", None, prefix))
    return docs[0], docs[1], questions


def run_chats(loaded: Any, variants: dict[str, dict[str, Any]], *, length: int, keys: int, pairs: int,
              ratio: float, book: str, seed: int = 0,
              note: Callable[[str], None] | None = None) -> dict[str, ChatArm]:
    """Every arm's greedy score of each question of each pair's chat (see the module docstring)."""
    tok = loaded.tokenizer

    def count(s: str) -> int:
        return len(tok.encode(s, add_special_tokens=False))

    arms = {"full": ChatArm("full", {})}
    arms.update({name: ChatArm(name, ov) for name, ov in variants.items()})
    for k in range(pairs):
        doc1, doc2, questions = chat_questions(length, keys, seed * 1_000_003 + k, count, book)
        staged = Session(loaded, method="full")
        staged.ingest(doc1, compress=False)
        for name, arm in arms.items():
            fork = (staged.fork(method="full", ratio=1.0) if name == "full" else
                    staged.fork(method="s4r", ratio=ratio, config_overrides=arm.overrides))
            fork.ingest(doc2)
            row, said = [], []
            for sample in questions:
                budget = answer_budget(sample, count, 32)
                answer, _ = fork.ask(sample.question, prime=sample.answer_prefix, max_new_tokens=budget)
                row.append(float(score(sample, answer)))
                said.append(answer)
            arm.scores.append(row)
            arm.answers.append(said)
            arm.ratio.append(fork.memory().ratio)
        if note is not None:
            note(f"pair {k + 1}: " + ", ".join(
                f"{n} {''.join('x' if s else '.' for s in a.scores[-1])} x{a.ratio[-1]:.2f}"
                for n, a in arms.items()))
    return arms


def _halves(rows: Sequence[Sequence[float]]) -> tuple[list[float], list[float]]:
    """Per chat, the mean score of its first and of its second half of questions."""
    half = len(rows[0]) // 2
    return ([sum(r[:half]) / half for r in rows], [sum(r[half:]) / (len(r) - half) for r in rows])


def summary(arms: dict[str, ChatArm]) -> dict[str, Any]:
    """Per arm: mean score [95%] per question position and per half of the chat, each half's paired gap to
    the full cache, the drift (second half minus first) paired against the full cache's, mean ratio."""
    full = arms["full"]
    full_early, full_late = _halves(full.scores)
    out = {}
    for name, arm in arms.items():
        early, late = _halves(arm.scores)
        positions = [mean_interval([row[i] for row in arm.scores]) for i in range(len(arm.scores[0]))]
        cells: dict[str, Any] = {"positions": [asdict(p) for p in positions],
                                 "ratio": sum(arm.ratio) / len(arm.ratio), "raw": asdict(arm)}
        for label, mine, ref in (("early", early, full_early), ("late", late, full_late)):
            acc, gap = mean_interval(mine), paired_gap(mine, ref)
            cells[label] = {"score": acc.mean, "low": acc.low, "high": acc.high, "n": acc.n,
                            "gap": gap.mean, "gap_low": gap.low, "gap_high": gap.high}
        drift = paired_gap([b - a for a, b in zip(early, late, strict=True)],
                           [b - a for a, b in zip(full_early, full_late, strict=True)])
        cells["drift_vs_full"] = {"gap": drift.mean, "low": drift.low, "high": drift.high}
        out[name] = cells
    return out


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m research.long_chat [--pairs 12] [--keys 5] [--length 2048] [--ratio 5] [--book B]
    [--seed S] [--variants s4r,own-bases] [--json PATH]`."""
    from s4r.models.loading import load_model

    parser = measuring_parser("python -m research.long_chat", __doc__, length=2048, book=HELDOUT_BOOK,
                              length_help="tokens of each document")
    parser.add_argument("--keys", type=int, default=5, help="needles (questions) per document")
    parser.add_argument("--pairs", type=int, default=12)
    parser.add_argument("--ratio", type=float, default=5.0)
    parser.add_argument("--variants", default="s4r", help=f"of {', '.join(VARIANTS)}")
    args = parser.parse_args(argv)
    variants = chosen_variants(parser, args.variants, VARIANTS)
    loaded = load_model(args.model)
    note = ElapsedLog()
    arms = run_chats(loaded, variants, length=args.length, keys=args.keys,
                     pairs=args.pairs, ratio=args.ratio, book=args.book, seed=args.seed, note=note)
    result = summary(arms)
    for name, res in result.items():
        per = " ".join(f"{p['mean']:.0f}" for p in res["positions"])
        halves = "  ".join(
            f"{label} {res[label]['score']:.0f} [{res[label]['low']:.0f}-{res[label]['high']:.0f}] "
            f"gap {res[label]['gap']:+.1f} [{res[label]['gap_low']:+.1f}, {res[label]['gap_high']:+.1f}]"
            for label in ("early", "late"))
        drift = res["drift_vs_full"]
        print(f"{name:10s} x{res['ratio']:.2f}  by question: {per}  |  {halves}  |  drift vs full "
              f"{drift['gap']:+.1f} [{drift['low']:+.1f}, {drift['high']:+.1f}]  n={res['early']['n']}")
    note.finish(args.json, {"args": vars(args), "arms": result})


if __name__ == "__main__":
    main()
