"""Peak memory and time of one document ingest, measured in a process of its own.

    python -m s4r.bench.ingest_memory --tokens 7000 --method s4r --ingest layerwise

loads the model, waits until it is resident, resets the process's peak mark, ingests a book passage
of about `--tokens` tokens and prints one JSON object: the peak above the resident size just before
the ingest (RSS on CPU, allocated bytes on CUDA), the resident size after it, the cache's own bytes and
the time. Run each configuration in a fresh process (peaks are per process) and compare side by side.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from s4r.hf.hidden_spill import SPILL_MODES
from s4r.models.loading import load_model
from s4r.runtime.memory import (
    current_memory_bytes,
    peak_memory_bytes,
    release_freed_memory,
    reset_peak_memory,
)
from s4r.runtime.session import INGEST_MODES, Session


def passage(tokenizer, tokens: int, book: str | None) -> str:
    """About `tokens` tokens of a book (repeated when it is shorter), as text."""
    from s4r.books import load_book  # lazy: only the probe needs a book

    text = load_book(book) if book else load_book()
    ids = tokenizer.encode(text, add_special_tokens=False)
    while len(ids) < tokens:
        ids = ids + ids
    return tokenizer.decode(ids[:tokens])


def measure(args: argparse.Namespace) -> dict:
    """Ingest once as `args` says and return the figures (see the module docstring)."""
    loaded = load_model(args.model, device=args.device, dtype=args.dtype, rope_scaling=args.rope_scaling)
    text = passage(loaded.tokenizer, args.tokens, args.book)
    device = torch.device(loaded.device)
    # touch the weights and every library path once (SVD, attention kernels) so the one-time costs of
    # a process are resident before the peak mark is reset
    warm = Session(loaded, method="s4r", ratio=2.0, chunk_size=args.chunk_size)
    warm.ingest(text[: len(text) * 600 // max(args.tokens, 600)])
    warm.ask("Hi", max_new_tokens=1)
    del warm
    session = Session(loaded, method=args.method, ratio=args.ratio, ingest=args.ingest,
                      chunk_size=args.chunk_size, hidden_spill=args.hidden_spill)
    release_freed_memory(device)
    before = current_memory_bytes(device) or 0
    resettable = reset_peak_memory(device)
    t0, c0 = time.perf_counter(), time.process_time()
    stats = session.ingest(text)
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    peak = peak_memory_bytes(device)
    after = current_memory_bytes(device) or 0
    mem = session.memory()
    return {"model": loaded.name, "device": str(device), "method": args.method, "ratio": args.ratio,
            "ingest": stats.mode, "hidden_spill": args.hidden_spill, "hidden_spilled": stats.hidden_spilled,
            "tokens": stats.tokens, "seconds": round(seconds, 3),
            # CPU time of the process: on a busy machine a fairer measure of the work than wall time
            "cpu_seconds": round(cpu_seconds, 3),
            "prefill_seconds": round(stats.prefill_seconds, 3),
            "compress_seconds": round(stats.compress_seconds, 3),
            "before_bytes": before, "peak_bytes": peak, "peak_above_bytes": peak - before,
            "after_above_bytes": after - before, "kv_bytes": mem.stored_bytes,
            "kv_full_bytes": mem.full_bytes,
            "peak_resettable": resettable, "rope_scaling": args.rope_scaling}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=7000)
    parser.add_argument("--method", default="s4r")
    parser.add_argument("--ratio", type=float, default=5.0)
    parser.add_argument("--ingest", choices=INGEST_MODES, default="layerwise")
    parser.add_argument("--chunk-size", type=int, default=512)
    parser.add_argument("--hidden-spill", choices=SPILL_MODES, default="auto",
                        help="layer-wise: hidden states between layers in a temp file (auto: long texts)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rope-scaling", type=float, default=None)
    parser.add_argument("--book", default=None)
    args = parser.parse_args(argv)
    print(json.dumps(measure(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
