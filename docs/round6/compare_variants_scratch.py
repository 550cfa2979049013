"""The scratch runner of the first round-6 tuning runs (v1-v4): `research.tuning.compare_variants` with
the variants of a JSON file (overrides by name), at 4k tokens of the tuning book, ratio 5 unless told.

    OMP_NUM_THREADS=1 python docs/round6/compare_variants_scratch.py \
        docs/round6/variants-v2.json 5 11 out.json [tasks] [ratio]
"""

import json
import sys
import time

import torch

from research.tuning import compare_variants
from s4r.models.loading import load_model

torch.set_num_threads(1)
with open(sys.argv[1]) as f:
    variants = json.load(f)
samples, seed, out = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
tasks = sys.argv[5].split(",") if len(sys.argv) > 5 else ["niah_multivalue", "niah_multiquery"]
ratio = float(sys.argv[6]) if len(sys.argv) > 6 else 5.0
loaded = load_model("smollm2-135m")
t0 = time.perf_counter()
res = compare_variants(loaded, variants, tasks=tasks, length=4096, samples=samples, ratio=ratio, seed=seed,
                       note=lambda m: print(f"[{time.perf_counter() - t0:.0f}s] {m}", flush=True))
rows = {}
for name, r in res.items():
    g = r.gap(res["full"]) if name != "full" else None
    rows[name] = {"nll": r.nll, "ratio": r.ratio, "gap": None if g is None else [g.mean, g.low, g.high, g.n]}
    if g is not None:
        print(f"{name:28s} gap {g.mean:+.3f} [{g.low:+.3f},{g.high:+.3f}] n={g.n}")
with open(out, "w") as f:
    json.dump(rows, f, indent=1)
