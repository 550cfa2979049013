"""How many documents `s4r serve` keeps warm within one memory budget, s4r against the full cache, and
the time to the first answer token for a document in memory, on disk, or read for the first time.

Documents are consecutive excerpts of the shipped books, cut to `--doc-tokens` tokens each. For each
method, a store with the same budget (`--budget-docs` full-cache documents' worth of bytes) reads
`--docs` documents; the documents still in memory at the end are counted. Time to first token is one
answer token (`max_tokens=1`) on a new document (read and compressed now), on the same document again (in
memory), and after it left memory for the cache folder (loaded back). Run with OMP_NUM_THREADS=1.

    PYTHONPATH=. OMP_NUM_THREADS=1 python -m research.serve_capacity --json serve_capacity.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from typing import Any

import torch

from s4r.books import book_text
from s4r.models.loading import load_model
from s4r.serving.document_store import DocumentStore
from s4r.serving.engine import Engine
from s4r.serving.generate import Sampling
from s4r.serving.prompt import Message

QUESTION = "Who is speaking in this passage?"


def excerpts(tokenizer: Any, count: int, tokens: int) -> list[str]:
    """`count` consecutive excerpts of `tokens` tokens from the shipped books."""
    out: list[str] = []
    for book in ("pride-and-prejudice", "romeo-and-juliet"):
        ids = tokenizer.encode(book_text(book), add_special_tokens=False)
        for start in range(0, len(ids) - tokens, tokens):
            out.append(tokenizer.decode(ids[start:start + tokens]))
            if len(out) == count:
                return out
    raise SystemExit(f"the books hold fewer than {count} excerpts of {tokens} tokens")


def first_token_s(engine: Engine, doc: str) -> tuple[float, str]:
    """Seconds to one answer token over `doc`, and where its cache came from."""
    t0 = time.perf_counter()
    c = engine.complete([Message("user", doc), Message("user", QUESTION)], Sampling(max_tokens=1))
    return time.perf_counter() - t0, c.cache


def run_method(loaded: Any, method: str, ratio: float, docs: list[str], budget: int) -> dict[str, Any]:
    """Read every document into a store of `budget` bytes; count those left in memory; time first tokens."""
    with tempfile.TemporaryDirectory() as folder:
        store = DocumentStore(loaded, budget_bytes=budget, cache_dir=folder,
                              session_kwargs={"method": method, "ratio": ratio})
        engine = Engine(loaded, store, min_document_tokens=64)
        cold, warm = [], []
        for doc in docs:
            s, source = first_token_s(engine, doc)
            assert source == "new"
            cold.append(s)
            s, source = first_token_s(engine, doc)
            assert source == "memory", source
            warm.append(s)
        snap = store.snapshot()
        disk = []
        for doc in docs[:min(3, len(docs) - snap.resident_documents)]:  # the oldest left memory first
            s, source = first_token_s(engine, doc)
            assert source == "disk", source
            disk.append(s)
        return {"method": method, "ratio_requested": ratio, "resident_documents": snap.resident_documents,
                "resident_bytes": snap.resident_bytes, "achieved_ratio": snap.ratio,
                "doc_stored_bytes": statistics.median(d.stored_bytes for d in store.documents()),
                "ttft_cold_s": statistics.median(cold), "ttft_warm_s": statistics.median(warm),
                "ttft_disk_s": statistics.median(disk) if disk else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--ratio", type=float, default=5.0)
    parser.add_argument("--docs", type=int, default=24)
    parser.add_argument("--doc-tokens", type=int, default=2000)
    parser.add_argument("--budget-docs", type=float, default=4.5,
                        help="the budget in full-cache documents' bytes")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    loaded = load_model(args.model, device="cpu", dtype="auto")
    docs = excerpts(loaded.tokenizer, args.docs, args.doc_tokens)
    t0 = time.perf_counter()
    full = run_method(loaded, "full", 1.0, docs[:1], 2**50)  # the size of one document first
    budget = int(full["doc_stored_bytes"] * args.budget_docs)
    full = run_method(loaded, "full", 1.0, docs, budget)
    s4r = run_method(loaded, "s4r", args.ratio, docs, budget)
    record = {"model": args.model, "docs": args.docs, "doc_tokens": args.doc_tokens, "budget_bytes": budget,
              "threads": torch.get_num_threads(), "full": full, "s4r": s4r,
              "warm_documents_ratio": s4r["resident_documents"] / max(full["resident_documents"], 1),
              "seconds": time.perf_counter() - t0}
    print(json.dumps(record, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
