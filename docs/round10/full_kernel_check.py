"""Round 10: does the full cache's new decode kernel (two bf16 products around an fp32 softmax,
`s4r.hf.attention.matmul_attention`) give the answers SDPA gave? Per sample, one prefill, then the full cache
with each kernel: the answer NLL (teacher-forced, token by token) and the greedy answer and its score.

    python docs/round10/full_kernel_check.py --book romeo-and-juliet --samples 8 --json out.json
"""

from __future__ import annotations

import argparse
import json

import torch

import s4r.hf.attention as attention
from research.tuning import answer_nll, paired_gap
from s4r.bench.intervals import mean_interval
from s4r.bench.scoring import score
from s4r.bench.tasks import answer_budget, make_samples
from s4r.models.loading import load_model
from s4r.runtime.session import Session


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--book", default="romeo-and-juliet")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--seed", type=int, default=60)
    parser.add_argument("--tasks", default="frequent_words,niah_multivalue,niah_single_book,niah_multikey")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    loaded = load_model("smollm2-135m")
    tok = loaded.tokenizer

    def count(s: str) -> int:
        return len(tok.encode(s, add_special_tokens=False))

    threshold = attention.MATMUL_MIN_KEYS
    rows = []
    for task in args.tasks.split(","):
        samples = make_samples(task, args.length, args.samples, args.seed, count, book=args.book)
        for k, sample in enumerate(samples):
            staged = Session(loaded, method="full")
            staged.ingest(sample.context, compress=False)
            row = {"task": task, "sample": k}
            for name, min_keys in (("matmul", threshold), ("sdpa", 1 << 40)):
                attention.MATMUL_MIN_KEYS = min_keys
                fork = staged.fork(method="full", ratio=1.0)
                row[f"{name}_nll"] = answer_nll(fork, sample)
                answer, _ = fork.ask(sample.question, prime=sample.answer_prefix,
                                     max_new_tokens=answer_budget(sample, count, 32))
                row[f"{name}_answer"], row[f"{name}_score"] = answer, float(score(sample, answer))
            attention.MATMUL_MIN_KEYS = threshold
            rows.append(row)
            print(f"{task} #{k + 1}: nll {row['matmul_nll']:.4f} / {row['sdpa_nll']:.4f}, score "
                  f"{row['matmul_score']:.0f} / {row['sdpa_score']:.0f}, same answer "
                  f"{row['matmul_answer'] == row['sdpa_answer']}", flush=True)
    gap = paired_gap([r["matmul_nll"] for r in rows], [r["sdpa_nll"] for r in rows])
    same = sum(r["matmul_answer"] == r["sdpa_answer"] for r in rows)
    scores = {n: mean_interval([r[f"{n}_score"] for r in rows]) for n in ("matmul", "sdpa")}
    print(f"answer NLL matmul - sdpa: {gap.mean:+.4f} [{gap.low:+.4f}, {gap.high:+.4f}] n={len(rows)}; "
          f"identical greedy answers {same}/{len(rows)}; score matmul {scores['matmul'].mean:.1f}, "
          f"sdpa {scores['sdpa'].mean:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
