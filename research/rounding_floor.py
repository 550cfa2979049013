"""How far greedy scores move between two exact caches: the noise floor under a task's bar.

    python -m research.rounding_floor --tasks variable_tracking --samples 20 --seed 0 \
        --book romeo-and-juliet --methods s4r@5 --json out.json

Per sample, one prefill is forked into the full cache (the reference of every comparison), a second
exact cache that differs from it only in rounding (`full (sdpa)`: the same keys and values attended
through SDPA alone instead of bf16 matrix products), and each `--methods`
entry. Every arm answers greedily, as `s4r bench` does. A task whose score moves as much between the two
exact caches as between the full cache and a compressed one measures rounding there, not compression:
near-ties in the model's choices (a list's bullet or a sentence, which filler line comes next) decide
the score.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from research.merge_runs import parse_methods
from research.progress import ElapsedLog, measuring_parser
from s4r.bench.decode_speed import sdpa_full_fork
from s4r.bench.haystack import HELDOUT_BOOK
from s4r.bench.intervals import Interval, difference_interval, score_interval
from s4r.bench.scoring import score
from s4r.bench.tasks import TASKS, answer_budget, make_samples
from s4r.runtime.session import Session

__all__ = ["EXACT_TWIN", "FloorArm", "FloorRow", "exact_twin", "floor_summary", "run_floor"]

REFERENCE = "full"
EXACT_TWIN = "full (sdpa)"


@dataclass
class FloorArm:
    """One arm's greedy scores and answers, sample by sample (the same samples for every arm)."""

    name: str
    scores: list[float] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)


def exact_twin(staged: Session) -> Session:
    """A full-cache fork of `staged` whose layers attend through SDPA only (exact; other rounding)."""
    fork = staged.fork(method="full", ratio=1.0)
    fork.cache = sdpa_full_fork(staged.cache)
    return fork


def run_floor(loaded, *, task: str, length: int, samples: int, seed: int, book: str,
              methods: Sequence[tuple[str, float]], max_new_tokens: int = 32,
              note: Callable[[str], None] | None = None) -> dict[str, FloorArm]:
    """Greedy scores of the full cache, its exact twin and each `(method, ratio)` on `samples` samples of
    `task` at `length` tokens of `book` (the samples `s4r bench` draws with the same seed)."""
    tok = loaded.tokenizer

    def count(s: str) -> int:
        return len(tok.encode(s, add_special_tokens=False))

    labels = [REFERENCE, EXACT_TWIN, *(f"{m}@{r:g}" for m, r in methods)]
    arms = {label: FloorArm(label) for label in labels}
    for k, sample in enumerate(make_samples(task, length, samples, seed, count, book=book)):
        staged = Session(loaded, method="full")
        staged.ingest(sample.context, compress=False)
        forks = [staged.fork(method="full", ratio=1.0), exact_twin(staged),
                 *(staged.fork(method=m, ratio=r) for m, r in methods)]
        budget = answer_budget(sample, count, max_new_tokens)
        for label, fork in zip(labels, forks, strict=True):
            answer, _ = fork.ask(sample.question, prime=sample.answer_prefix, max_new_tokens=budget)
            arms[label].scores.append(float(score(sample, answer)))
            arms[label].answers.append(answer)
        if note is not None:
            note(f"{task} #{k + 1}: " + ", ".join(f"{a.name} {a.scores[-1]:.0f}" for a in arms.values()))
    return arms


@dataclass(frozen=True)
class FloorRow:
    """An arm's mean score, its paired difference to the full cache and how many answers differ."""

    name: str
    score: Interval
    vs_full: Interval
    changed: int  # samples whose answer text differs from the full cache's


def floor_summary(arms: dict[str, FloorArm]) -> list[FloorRow]:
    """One `FloorRow` per arm, the reference first."""
    ref = arms[REFERENCE]
    return [FloorRow(a.name, score_interval(a.scores),
                     difference_interval([x - y for x, y in zip(a.scores, ref.scores, strict=True)]),
                     sum(x != y for x, y in zip(a.answers, ref.answers, strict=True)))
            for a in arms.values()]


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m research.rounding_floor`: per task, the scores, paired gaps to the full cache and changed
    answers of the exact twin and each compressed arm (see the module's docstring)."""
    from s4r.models.loading import load_model
    from s4r.runtime.threads import apply_threads

    parser = measuring_parser("python -m research.rounding_floor", __doc__, length=4096, book=HELDOUT_BOOK)
    parser.add_argument("--tasks", default="variable_tracking", help="comma list of the suite's tasks")
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--methods", default="s4r@5", help="name@ratio list of compressed arms")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    tasks = [t for t in args.tasks.split(",") if t]
    if unknown := [t for t in tasks if t not in TASKS]:
        parser.error(f"unknown task(s) {', '.join(unknown)}; choose from {', '.join(TASKS)}")
    apply_threads(args.threads)
    loaded = load_model(args.model)
    log = ElapsedLog()
    methods = sorted(parse_methods(args.methods))
    record: dict[str, dict] = {}
    for task in tasks:
        arms = run_floor(loaded, task=task, length=args.length, samples=args.samples, seed=args.seed,
                         book=args.book, methods=methods, note=log)
        rows = floor_summary(arms)
        for row in rows:
            s, d = row.score, row.vs_full
            print(f"{task:<20} {row.name:<12} {s.mean:5.1f} [{s.low:.1f}-{s.high:.1f}]"
                  f"  vs full {d.mean:+5.1f} [{d.low:+.1f}, {d.high:+.1f}]"
                  f"  answers changed {row.changed}/{len(arms[REFERENCE].scores)}")
        record[task] = {"arms": {n: asdict(a) for n, a in arms.items()},
                        "summary": [{"name": r.name, "score": r.score.to_dict(),
                                     "vs_full": r.vs_full.to_dict(), "changed": r.changed} for r in rows]}
    log.finish(args.json, {"config": vars(args), "tasks": record})


if __name__ == "__main__":
    main()
