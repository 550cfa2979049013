"""Chat-speed table: a REPL conversation over two documents, the full cache against each method, side by side.

    python -m s4r.bench.chat_speed --threads 1
    python -m s4r.bench.chat_speed --first 1900 --second 2100 --methods s4r --ratios 5 --repeats 3

What a user times in the REPL: a first document read (not timed: both caches prefill it the same way),
then a second one appended with `/read` (timed: it attends to the first, compressed or not), then a
question (its prompt's tokens per second and time to first token) and a fixed-length answer (decode
tokens per second). Every repetition runs each session once, in turn, so a machine that speeds up or
slows down affects every row alike; figures are medians over the repetitions and ratios to `full`.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace

import torch

from s4r.bench.decode_speed import method_spec
from s4r.books import BookNotFoundError, load_book

QUESTION = "Who is Tybalt, and what does he do?"


@dataclass
class ChatRow:
    """Median figures of one session kind over the repetitions, and their ratios to the full cache's."""

    name: str
    read_s: float
    prompt_tok_s: float
    ttft_s: float
    answer_tok_s: float
    read_ratio: float = 1.0  # seconds / full's seconds (lower is faster)
    prompt_ratio: float = 1.0  # tok/s / full's tok/s
    answer_ratio: float = 1.0
    kv_ratio: float = 1.0  # achieved compression: full bytes / stored bytes


def documents(tokenizer, first: int, second: int, book: str) -> tuple[str, str]:
    """Two consecutive passages of `book` of about `first` and `second` tokens (decoded back to text)."""
    ids = tokenizer.encode(load_book(book), add_special_tokens=False)
    start = min(len(ids) // 4, max(0, len(ids) - first - second))
    one = ids[start : start + first]
    two = ids[start + first : start + first + second]
    return tokenizer.decode(one), tokenizer.decode(two)


def one_chat(loaded, method: str, ratio: float, docs: tuple[str, str],
             answer_tokens: int) -> dict[str, float]:
    """Run the conversation once in a new session: the figures a user would see. `method` may carry
    settings (`s4r+dense_queries=0`, as `decode_speed.method_spec` reads them)."""
    from s4r.runtime.session import Session

    name, overrides = method_spec(method)
    session = Session(loaded, method=name, ratio=ratio, config_overrides=overrides or None)
    session.ingest(docs[0], name="first")
    t0 = time.perf_counter()
    session.ingest(docs[1], name="second")
    read_s = time.perf_counter() - t0
    _, stats = session.ask(QUESTION, max_new_tokens=answer_tokens, loop_guard=False)
    report = session.memory()
    return {"read_s": read_s, "prompt_tok_s": stats.prefill_tok_s, "ttft_s": stats.ttft_s,
            "answer_tok_s": stats.decode_tok_s, "generated": stats.generated_tokens,
            "kv_ratio": report.ratio}


def measure(loaded, combos: list[tuple[str, float]], docs: tuple[str, str], repeats: int,
            answer_tokens: int, log=lambda m: None) -> list[ChatRow]:
    """Interleaved repetitions of the conversation for the full cache and every (method, ratio)."""
    kinds = [("full", 1.0), *combos]
    runs: dict[int, list[dict[str, float]]] = {j: [] for j in range(len(kinds))}
    one_chat(loaded, *kinds[-1], docs, 4)  # warm-up: first calls compile kernels and fill tables
    for rep in range(repeats):
        for j, (method, ratio) in enumerate(kinds):
            runs[j].append(one_chat(loaded, method, ratio, docs, answer_tokens))
            log(f"repeat {rep + 1}/{repeats} {method}@{ratio:g}: {runs[j][-1]}")
    rows = []
    for j, (method, ratio) in enumerate(kinds):
        med = {k: statistics.median(r[k] for r in runs[j]) for k in runs[j][0]}
        name = "full" if method == "full" else f"{method}@{ratio:g}"
        rows.append(ChatRow(name, med["read_s"], med["prompt_tok_s"], med["ttft_s"], med["answer_tok_s"],
                            kv_ratio=med["kv_ratio"]))
    full = rows[0]
    for row in rows:
        row.read_ratio = row.read_s / full.read_s
        row.prompt_ratio = row.prompt_tok_s / full.prompt_tok_s
        row.answer_ratio = row.answer_tok_s / full.answer_tok_s
    return rows


def block_sweep(loaded, method: str, ratio: float, docs: tuple[str, str], sizes: list[int],
                repeats: int = 7) -> list[tuple[int, float, float]]:
    """One layer (the middle one) of the two-document cache attending a block of q random queries, for
    each q of `sizes`: (q, median ms through the selection, median ms attending every stored token),
    the two interleaved; each dense call rebuilds (nothing kept from the previous one)."""
    from s4r.layers import lowrank_dense
    from s4r.runtime.session import Session

    name, overrides = method_spec(method)
    session = Session(loaded, method=name, ratio=ratio, config_overrides=overrides or None)
    session.ingest(docs[0], name="first")
    session.ingest(docs[1], name="second")
    layer = session.cache.layers[len(session.cache.layers) // 2]
    first = getattr(layer, "segments", [layer])[0]
    heads, q_heads, d, dtype = first.heads, session.shape.q_heads, first.head_dim, first.dtype
    scaling = d ** -0.5
    out = []
    for q_len in sizes:
        copies = []
        for dense in (0, 1):
            twin = copy.deepcopy(layer)
            for seg in getattr(twin, "segments", [twin]):
                seg.cfg = replace(seg.cfg, dense_queries=dense)
            new = torch.randn(1, heads, q_len, d, dtype=dtype)
            twin.update(new, new.clone())
            copies.append(twin)
        query = torch.randn(1, q_heads, q_len, d, dtype=dtype)
        times: list[list[float]] = [[], []]
        with torch.inference_mode():
            for rep in range(repeats + 1):
                for j, twin in enumerate(copies):
                    lowrank_dense.forget_rebuilt()
                    t0 = time.perf_counter()
                    twin.attend(query, None, None, scaling)
                    if rep:  # the first round warms up
                        times[j].append((time.perf_counter() - t0) * 1e3)
        out.append((q_len, statistics.median(times[0]), statistics.median(times[1])))
    return out


def sweep_markdown(sweep: list[tuple[int, float, float]]) -> str:
    """The block sweep as BENCHMARKS.md shows it."""
    lines = ["| queries in the block | selection ms | every token ms | selection / every token |",
             "|---|---|---|---|"]
    for q_len, chosen, dense in sweep:
        lines.append(f"| {q_len} | {chosen:.2f} | {dense:.2f} | {chosen / dense:.2f}x |")
    return "\n".join(lines)


def markdown(rows: list[ChatRow]) -> str:
    """The table as BENCHMARKS.md shows it."""
    lines = ["| cache | KV ratio | `/read` s (× full) | prompt tok/s (× full) | first token s "
             "| answer tok/s (× full) |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.name} | {r.kv_ratio:.2f} | {r.read_s:.1f} ({r.read_ratio:.2f}×) | "
                     f"{r.prompt_tok_s:.1f} ({r.prompt_ratio:.2f}×) | {r.ttft_s:.2f} | "
                     f"{r.answer_tok_s:.2f} ({r.answer_ratio:.2f}×) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m s4r.bench.chat_speed",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model", "-m", default="smollm2-135m")
    parser.add_argument("--book", default="romeo-and-juliet")
    parser.add_argument("--first", type=int, default=1900, help="tokens of the first document")
    parser.add_argument("--second", type=int, default=2100, help="tokens of the document `/read` appends")
    parser.add_argument("--methods", default="s4r",
                        help="methods, each optionally with settings: s4r,s4r+dense_queries=0")
    parser.add_argument("--ratios", default="5")
    parser.add_argument("--answer-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--block-sweep", default="",
                        help="also time one layer attending blocks of these many queries, through the "
                        "selection and attending every token (e.g. 1,2,4,8,16,32)")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    try:
        combos = [(m, float(r)) for m in args.methods.split(",") for r in args.ratios.split(",")]
        sizes = [int(x) for x in args.block_sweep.split(",") if x.strip()]
        from s4r.methods import make_method

        for spec, ratio in combos:
            name, overrides = method_spec(spec)
            make_method(name, ratio, overrides or None)
        load_book(args.book)
    except (ValueError, BookNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    from s4r.models.loading import load_model

    loaded = load_model(args.model, device=args.device)
    docs = documents(loaded.tokenizer, args.first, args.second, args.book)
    rows = measure(loaded, combos, docs, args.repeats, args.answer_tokens,
                   log=lambda m: print(m, file=sys.stderr))
    print(markdown(rows))
    sweep = block_sweep(loaded, *combos[0], docs, sizes) if sizes else []
    if sweep:
        print()
        print(sweep_markdown(sweep))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv, "threads": torch.get_num_threads(), "device": str(loaded.device),
                       "rows": [asdict(r) for r in rows], "block_sweep": sweep}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
