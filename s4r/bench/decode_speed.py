"""Decode-speed table: every method's decode step against the fastest exact full cache, side by side.

    python -m s4r.bench.decode_speed --lengths 2k,4k,8k --ratios 2.5,5 --steps 32
    python -m s4r.bench.decode_speed --lengths 16k,32k --rope-scaling 4 --prefill 7600
    python -m s4r.bench.decode_speed --device cuda --random-weights -m llama-3.1-8b-instruct --lengths 32k,64k
    python -m s4r.bench.decode_speed --device cuda --random-weights --quant 4bit -m llama-3.1-8b-instruct

One prefill per length (book text, repeated past its end), then forks of the staged cache: `full`
(s4r's exact cache; grouped heads folded on a CPU, bf16 steps as two matrix products), each method at
each ratio, and for reference `full (sdpa)` (the same cache through SDPA alone) and
`transformers` (plain `DynamicCache` + sdpa, what an unmodified model runs). All forks decode the same tokens
one at a time in one interleaved loop (`teacher_force`), so a machine that speeds up or slows down
affects every row alike; figures are median milliseconds per token and the ratio to `full`.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from transformers import DynamicCache

from s4r.bench.config import parse_lengths
from s4r.bench.speed import teacher_force
from s4r.bench.weights_floor import WeightsFloor, lean_matrices, model_matrices
from s4r.books import BookNotFoundError, load_book
from s4r.core.budget import KVShape
from s4r.core.rope import model_rope_fn
from s4r.hf.attention import causal_attention, handoff_plain, install
from s4r.hf.cache import CompressedCache
from s4r.hf.generation import prefill
from s4r.hf.lean import STEPS, lean_step
from s4r.kernels.bf16_matvec import MatvecWeight
from s4r.layers.full import FullLayer, StagingLayer
from s4r.methods import CompressContext, make_method

PLAIN = "transformers"
SDPA_FULL = "full (sdpa)"


class PlainTransformersCache(DynamicCache):
    """transformers' own `DynamicCache`, whose layers run transformers' sdpa attention even in a model
    switched to s4r attention (the reference row of the speed table)."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        handoff_plain(keys)
        return keys, values

    def logical_length(self) -> int:
        return self.get_seq_length()


class SdpaFullLayer(FullLayer):
    """The exact full cache through SDPA alone: grouped heads folded, SDPA at every length (the reference
    row that shows what `matmul_attention` gains)."""

    def attend(self, query, key, value, scaling):
        return causal_attention(query, key, value, scaling, sdpa_only=True)


def sdpa_full_fork(staged: CompressedCache) -> CompressedCache:
    """A full-cache fork of `staged` whose layers attend through SDPA only (see `SdpaFullLayer`)."""
    cache = staged.copy_staged()
    cache.compress(lambda i, layer: SdpaFullLayer.from_staged(layer))
    return cache


@dataclass
class Fork:
    """What `teacher_force` steps: one model, one device, one cache."""

    name: str
    model: Any
    device: torch.device
    cache: Any
    ratio: float = 1.0
    step: str | None = None  # the decode step (`s4r.hf.lean.STEPS`); None: the model's own choice


@dataclass(frozen=True)
class SpeedRow:
    """One method at one length."""

    length: int
    method: str
    achieved_ratio: float
    median_ms: float
    vs_full: float
    steps: int
    kv_mib: float = 0.0  # what the cache holds (for the transformers row: its keys and values)
    nll: float | None = None  # mean next-token NLL over the timed steps (the forks should agree)
    weight_gb_s: float | None = None  # floor rows: bytes of weights per step over their median time


def staged_cache(model, ids: list[int], chunk_size: int = 512) -> CompressedCache:
    """The uncompressed cache of `ids` (with the last queries every method may need)."""
    install(model)  # s4r attention: the staging layers record the last queries
    param = next(model.parameters())
    shape = KVShape.from_config(model.config, param.element_size())
    cache = CompressedCache(shape.layers, shape, query_window=64)
    prefill(model, cache, torch.tensor(ids, device=param.device), 0, chunk_size)
    return cache


def tiled(staged: CompressedCache, length: int) -> CompressedCache:
    """A staged cache of `length` tokens made of `staged`'s keys, values and queries repeated (timing
    only: a decode step costs the same whatever the tokens say, and a real 32k prefill takes an hour on
    two CPU cores)."""
    other = CompressedCache(len(staged.layers), staged.shape)
    for i, layer in enumerate(staged.layers):
        reps = -(-length // layer.logical)
        copy = StagingLayer(layer.query_window)
        copy.update(layer.keys_view.repeat(1, 1, reps, 1)[:, :, :length].contiguous(),
                    layer.values_view.repeat(1, 1, reps, 1)[:, :, :length].contiguous())
        copy.queries = None if layer.queries is None else layer.queries.clone()
        other.layers[i] = copy
    return other


def plain_fork(model, staged: CompressedCache) -> PlainTransformersCache:
    """A `PlainTransformersCache` holding a copy of the staged keys and values."""
    cache = PlainTransformersCache(config=model.config)
    for i, layer in enumerate(staged.layers):
        cache.update(layer.keys_view.clone(), layer.values_view.clone(), i)
    return cache


def method_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """`s4r` or `s4r+recon_token_cap=2048+pool_kernel=3`: a method and settings of it (numbers, None,
    true/false or words), so one run can time a setting beside the default."""
    name, *settings = spec.split("+")
    overrides: dict[str, Any] = {}
    for item in settings:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"a setting is key=value, got '{item}'")
        try:
            overrides[key] = json.loads(raw.lower() if raw.lower() in ("true", "false") else raw)
        except json.JSONDecodeError:
            overrides[key] = None if raw == "None" else raw
    return name, overrides


def make_forks(model, staged: CompressedCache, combos: list[tuple[str, float]],
               decode_steps: Sequence[str] = ("lean",), reference_rows: bool = True) -> list[Fork]:
    """`full`, each (method spec, ratio) (see `method_spec`), each with every decode step of
    `decode_steps` (named "full [reference]" etc. when there are several), then, with `reference_rows`,
    `full (sdpa)` (the first decode step) and the plain transformers reference (its own forward).

    Each fork gets a copy of `staged`, except the first `full` one: it takes over `staged` itself (built
    last, so the copies are made first), which saves one full cache of memory at long contexts."""
    device = next(model.parameters()).device
    rope = model_rope_fn(model)
    tagged = len(decode_steps) > 1

    def label(base: str, step: str) -> str:
        return f"{base} [{step}]" if tagged else base

    forks = []
    for spec, ratio in [("full", 1.0), *combos]:
        for step in decode_steps:
            if spec == "full" and step == decode_steps[0]:
                continue  # built from `staged` below
            cache = staged.copy_staged()
            name, overrides = method_spec(spec)
            make_method(name, ratio, overrides or None).compress(cache, CompressContext(rope, ratio))
            base = spec if spec == "full" else f"{spec} {ratio:g}"
            forks.append(Fork(label(base, step), model, device, cache, ratio, step))
    if reference_rows:
        forks.append(Fork(SDPA_FULL, model, device, sdpa_full_fork(staged), step=decode_steps[0]))
        forks.append(Fork(PLAIN, model, device, plain_fork(model, staged), step="reference"))
    make_method("full", 1.0).compress(staged, CompressContext(rope, 1.0))
    forks.insert(0, Fork(label("full", decode_steps[0]), model, device, staged, 1.0, decode_steps[0]))
    return forks


def weights_floors(model, decode_steps: Sequence[str]) -> list[WeightsFloor]:
    """One weights-read floor per matrix dtype the decode steps read: the model's own matrices for the
    reference step, the lean step's stacked ones for a lean step (when it can run the model)."""
    floors: dict[tuple[torch.dtype, bool], WeightsFloor] = {}
    for step in decode_steps:
        lean = None if step == "reference" else lean_step(model, step)
        matrices = lean_matrices(lean) if lean is not None else model_matrices(model)
        kernel = isinstance(matrices[0], MatvecWeight)
        dtype = matrices[0].tensor.dtype if kernel else matrices[0].dtype
        name = f"floor: weights {str(dtype).removeprefix('torch.')}{' (bf16_matvec)' * kernel}"
        floors.setdefault((dtype, kernel), WeightsFloor(name, matrices))
    return list(floors.values())


def book_ids(tokenizer, tokens: int, book: str | None = None) -> list[int]:
    """`tokens` token ids of `book` (default: the default book), repeated past its end (timing needs no
    natural text)."""
    ids = tokenizer.encode(load_book() if book is None else load_book(book), add_special_tokens=False)
    return (ids * (tokens // len(ids) + 1))[:tokens]


def measure(loaded, lengths: list[int], combos: list[tuple[str, float]], steps: int, warmup: int,
            log=print, prefill_tokens: int | None = None, decode_steps: Sequence[str] = ("lean",),
            reference_rows: bool = True, floor: bool = True, book: str | None = None) -> list[SpeedRow]:
    """The speed table's rows: per length one prefill (or, past `prefill_tokens`, that prefill tiled to
    the length), the forks, one interleaved decode loop; with `floor`, after each step of the loop the
    weights-read floor of each matrix dtype (`weights_floors`) is timed too."""
    model = loaded.model
    install(model)
    floors = weights_floors(model, decode_steps) if floor else []
    rows: list[SpeedRow] = []
    prefilled = None
    for length in lengths:
        ids = book_ids(loaded.tokenizer, length + steps + warmup, book)
        t0 = time.perf_counter()
        with torch.inference_mode():
            if prefill_tokens and length > prefill_tokens:
                if prefilled is None:
                    prefilled = staged_cache(model, ids[:prefill_tokens])
                staged = tiled(prefilled, length)
                seconds = time.perf_counter() - t0
                log(f"{length} tokens: {prefill_tokens} prefilled and tiled, {seconds:.1f} s")
            else:
                staged = staged_cache(model, ids[:length])
                log(f"{length} tokens: prefill {time.perf_counter() - t0:.1f} s")
            forks = make_forks(model, staged, combos, decode_steps, reference_rows)
        del staged
        decoded = ids[length:]
        nll = NllMeter(decoded, warmup)
        for f in floors:
            f.seconds.clear()
        timings = teacher_force(forks, decoded, warmup=warmup, on_logits=nll,
                                on_step=lambda i: [f.time_once(keep=i >= warmup) for f in floors])
        base = timings[0].median_ms
        for j, (fork, timing) in enumerate(zip(forks, timings, strict=True)):
            achieved = fork.cache.ratio() if isinstance(fork.cache, CompressedCache) else 1.0
            rows.append(SpeedRow(length, fork.name, achieved, timing.median_ms, base / timing.median_ms,
                                 timing.steps, cache_bytes(fork.cache) / 2**20, nll.mean(j)))
            log(f"  {fork.name:14s} {timing.median_ms:8.1f} ms/token  {base / timing.median_ms:5.2f}x full")
        for f in floors:
            ms = 1000 * statistics.median(f.seconds)
            rows.append(SpeedRow(length, f.name, 0.0, ms, base / ms, len(f.seconds),
                                 weight_gb_s=f.nbytes / ms / 1e6))
            log(f"  {f.name:14s} {ms:8.1f} ms/token  ({f.nbytes / 2**20:,.0f} MiB, "
                f"{f.nbytes / ms / 1e6:.1f} GB/s)")
        del forks
    return rows


class NllMeter:
    """`teacher_force`'s `on_logits`: each fork's mean NLL of the next decoded token over the timed steps."""

    def __init__(self, ids: Sequence[int], warmup: int) -> None:
        self.ids, self.warmup = list(ids), warmup
        self.sums: dict[int, list[float]] = {}

    def __call__(self, j: int, i: int, logits: torch.Tensor) -> None:
        if i >= self.warmup and i + 1 < len(self.ids):
            nll = -torch.log_softmax(logits.float(), dim=-1)[self.ids[i + 1]].item()
            self.sums.setdefault(j, []).append(nll)

    def mean(self, j: int) -> float | None:
        values = self.sums.get(j)
        return sum(values) / len(values) if values else None


def cache_bytes(cache: Any) -> int:
    """Bytes a fork's cache holds: `nbytes` of an s4r cache, keys plus values of a plain one."""
    if isinstance(cache, CompressedCache):
        return cache.nbytes()
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
               if t is not None)


def markdown(rows: list[SpeedRow]) -> str:
    """The rows as a markdown table."""
    lines = ["| length | method | achieved ratio | KV MiB | ms/token (median) | decode vs full | steps "
             "| NLL |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.weight_gb_s is not None:  # a floor row: no cache; its bandwidth where the ratio goes
            lines.append(f"| {r.length:,} | {r.method} | {r.weight_gb_s:.1f} GB/s | | {r.median_ms:.1f} | "
                         f"{r.vs_full:.2f}x | {r.steps} | |")
            continue
        nll = "" if r.nll is None else f"{r.nll:.4f}"
        lines.append(f"| {r.length:,} | {r.method} | {r.achieved_ratio:.2f} | {r.kv_mib:,.1f} | "
                     f"{r.median_ms:.1f} | {r.vs_full:.2f}x | {r.steps} | {nll} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m s4r.bench.decode_speed",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model", "-m", default="smollm2-135m")
    parser.add_argument("--lengths", default="2k,4k,8k")
    parser.add_argument("--methods", default="s4r",
                        help="methods, each optionally with settings: s4r,s4r+recon_token_cap=2048")
    parser.add_argument("--ratios", default="2.5,5")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps per fork")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rope-scaling", type=float, default=None)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--quant", default="none", choices=("none", "8bit", "4bit"),
                        help="bitsandbytes weights (CUDA), as `s4r chat --quant`")
    parser.add_argument("--random-weights", action="store_true",
                        help="the model's shape with random weights (timing only; no download)")
    parser.add_argument("--prefill", type=int, default=None,
                        help="prefill at most this many tokens; longer lengths tile that prefill "
                        "(timing only)")
    parser.add_argument("--dtype", default="auto", help="model dtype: auto, bf16, fp16 or fp32")
    parser.add_argument("--decode-steps", default="lean",
                        help=f"decode steps, each forking every cache: {', '.join(STEPS)} (lean: the lean "
                        "step, compiled where S4R_COMPILE allows; reference: the model's own forward)")
    parser.add_argument("--no-reference-rows", action="store_true",
                        help="leave out the full (sdpa) and transformers rows (two full caches less memory)")
    parser.add_argument("--book", default=None, help="the book prefilled (e.g. romeo-and-juliet)")
    parser.add_argument("--no-floor", action="store_true", help="leave out the weights-read floor rows")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    try:
        lengths = list(parse_lengths(args.lengths.split(",")))
        ratios = [float(x) for x in args.ratios.split(",")]
    except ValueError:
        print("error: --lengths like 2k,8k and --ratios like 2.5,5", file=sys.stderr)
        return 2
    decode_steps = [x.strip() for x in args.decode_steps.split(",") if x.strip()]
    if not decode_steps or not set(decode_steps) <= set(STEPS) or len(set(decode_steps)) < len(decode_steps):
        print(f"error: --decode-steps takes distinct names from {', '.join(STEPS)}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    from s4r.models.loading import load_model

    kwargs = {"rope_scaling": args.rope_scaling} if args.rope_scaling else {}
    loaded = load_model(args.model, device=args.device, random_weights=args.random_weights, quant=args.quant,
                        dtype=args.dtype, **kwargs)
    combos = [(m, r) for m in args.methods.split(",") for r in ratios]
    try:
        for spec, ratio in combos:
            name, overrides = method_spec(spec)
            make_method(name, ratio, overrides or None)
        if args.book is not None:
            load_book(args.book)
    except (ValueError, BookNotFoundError) as exc:  # a typo should not wait for the model and the prefill
        print(f"error: {exc}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    rows = measure(loaded, lengths, combos, args.steps, args.warmup, log=lambda m: print(m, file=sys.stderr),
                   prefill_tokens=args.prefill, decode_steps=decode_steps,
                   reference_rows=not args.no_reference_rows, floor=not args.no_floor, book=args.book)
    seconds = time.perf_counter() - t0
    print(markdown(rows))
    if args.json:
        with open(args.json, "w") as f:
            peak = torch.cuda.max_memory_allocated() if loaded.device.type == "cuda" else None
            json.dump({"argv": sys.argv, "threads": torch.get_num_threads(), "device": str(loaded.device),
                       "dtype": str(loaded.dtype), "quant": args.quant, "peak_device_bytes": peak,
                       "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                       "seconds": seconds, "rows": [asdict(r) for r in rows]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
