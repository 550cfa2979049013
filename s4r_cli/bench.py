"""`s4r bench`: accuracy, perplexity gap, speed and memory of every KV-cache method, side by side.

The measuring is `s4r.bench.runner`; this module parses options, shows progress (bars on a terminal,
plain lines otherwise), prints the summary tables and writes `--json` / `--plot`.
"""

from __future__ import annotations

import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from s4r_cli.common import (
    DEFAULT_MODEL,
    DeviceOpt,
    Dtype,
    DtypeOpt,
    ModelOpt,
    UsageError,
    check_device,
    check_model_spec,
    check_ratio,
    pipe_guard,
)
from s4r_cli.ui import UI, gib, is_tty, seconds

if TYPE_CHECKING:  # the library imports torch; keep `s4r bench --help` and option errors fast
    from s4r.bench.runner import BenchConfig, BenchResult

_RUN = "What to run"
_OUT = "Output"

# one line per paragraph: the help formatter wraps them to the terminal itself
HELP = "\n\n".join([
    "Benchmark the KV-cache methods against each other at equal stored bytes.",
    "Accuracy: RULER-style tasks at each context length; every sample is prefilled once and forked into "
    "every method and ratio. Perplexity gap: NLL of a 256-token book continuation read through each "
    "compressed cache (4k and 8k by default). Speed and memory: prefill and compression time, decode "
    "tokens/s measured side by side against full, stored KV bytes and achieved ratio, peak memory.",
    "--quick (2k, one sample of three tasks, every method but kvzip) is the CI smoke test.",
])


def _split(text: str | None) -> list[str]:
    return [p.strip() for p in (text or "").replace(";", ",").split(",") if p.strip()]


def parse_methods(text: str | None) -> tuple[str, ...] | None:
    """Comma-separated method names; a name no version of the benchmark knows is a usage error.

    Names the benchmark knows but this library cannot build are left to the runner, which skips them
    with a warning. `name@ratio` runs that method at that ratio only (see parse_method_ratios).
    """
    from s4r.bench.runner import DEFAULT_METHODS
    from s4r.methods import METHODS

    names = [n.split("@", 1)[0].strip() for n in _split(text)]
    if text is not None and not names:
        raise UsageError("--methods needs at least one method name")
    known = set(DEFAULT_METHODS) | set(METHODS)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise UsageError(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(sorted(known))}")
    return tuple(dict.fromkeys(names)) or None


def parse_method_ratios(text: str | None) -> dict[str, tuple[float, ...]]:
    """The ratios given as `name@ratio` in --methods, per method (methods without one use --ratios)."""
    out: dict[str, list[float]] = {}
    for part in _split(text):
        if "@" in part:
            name, ratio = (p.strip() for p in part.split("@", 1))
            try:
                value = float(ratio)
            except ValueError:
                raise UsageError(f"--methods: '{part}' needs a number after @") from None
            out.setdefault(name, []).append(check_ratio(value))
    return {m: tuple(dict.fromkeys(r)) for m, r in out.items()}


def parse_ratios(text: str | None) -> tuple[float, ...] | None:
    """Comma-separated compression ratios (each at least 1)."""
    if text is None:
        return None
    out = []
    for part in _split(text):
        try:
            value = float(part.removeprefix("x").removeprefix("×"))
        except ValueError:
            raise UsageError(f"--ratios: '{part}' is not a number") from None
        out.append(check_ratio(value))
    if not out:
        raise UsageError("--ratios needs at least one ratio")
    return tuple(dict.fromkeys(out))


def parse_length_list(text: str | None) -> tuple[int, ...] | None:
    """Comma-separated context lengths: tokens, with k = 1024 (2k,4k,8k or 2048,4096)."""
    if text is None:
        return None
    from s4r.bench.runner import parse_lengths

    try:
        lengths = parse_lengths(_split(text))
    except ValueError as exc:
        raise UsageError(f"--lengths: {exc}") from None
    if not lengths:
        raise UsageError("--lengths needs at least one length")
    if min(lengths) < 256:
        raise UsageError(f"--lengths: {min(lengths)} tokens is too short to compress (use at least 256)")
    return tuple(sorted(set(lengths)))


def parse_tasks(text: str | None) -> tuple[str, ...] | None:
    """Comma-separated task names (see s4r.bench.tasks.TASKS); `all` means every task, a name of
    TASK_SETS (`needles`) its tasks."""
    if text is None:
        return None
    from s4r.bench.tasks import TASK_SETS, TASKS

    names = _split(text)
    if names == ["all"]:
        return tuple(TASKS)
    names = [t for n in names for t in TASK_SETS.get(n, (n,))]
    unknown = [n for n in names if n not in TASKS]
    if unknown or not names:
        raise UsageError(f"unknown task(s) {', '.join(unknown) or '(none given)'}; choose from "
                         f"{', '.join(TASKS)}, {', '.join(TASK_SETS)} or all")
    return tuple(dict.fromkeys(names))


def parse_book(text: str | None) -> str | None:
    """The haystack book of the book tasks: the tuning or the held-out one."""
    if text is None:
        return None
    from s4r.bench.tasks import HELDOUT_BOOK, TUNING_BOOK

    if text not in (TUNING_BOOK, HELDOUT_BOOK):
        raise UsageError(f"--book: unknown book '{text}'; choose {TUNING_BOOK} (tuning) or {HELDOUT_BOOK} "
                         "(held out)")
    return text


def _check_output(path: str | None, option: str) -> Path | None:
    """An output path must not be a folder and must have a folder we can create."""
    if path is None:
        return None
    p = Path(path).expanduser()
    if p.is_dir():
        raise UsageError(f"{option} {path} is a directory; give a file name")
    parent = p.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(f"{option} {path}: {parent} is not a directory")
    return p


def _check_plot(path: Path | None) -> None:
    if path is None:
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 's4r[plot]'") from None
    supported = {".png", ".pdf", ".svg", ".jpg", ".jpeg"}
    if path.suffix.lower() not in supported:
        raise UsageError(f"--plot {path}: use one of {', '.join(sorted(supported))}")


# --- progress -------------------------------------------------------------------------------------------

class _Hooks:
    """s4r.bench.runner.BenchHooks for the terminal (duck-typed: subclassing would import torch before the
    options are checked): one rich bar per phase on a TTY, plain timestamped lines on stderr otherwise."""

    def __init__(self, err: Console, progress: Progress | None) -> None:
        self.err = err
        self.progress = progress
        self.plain = progress is None
        self.task: Any = None
        self.started = time.perf_counter()

    def phase(self, name: str, total: int) -> None:
        if self.progress is not None:
            if self.task is not None:
                self.progress.remove_task(self.task)
            self.task = self.progress.add_task(name, total=total or None, detail="")
        elif name != "setup":
            self.err.print(f"[{self._clock()}] {name}: {total:,} steps", markup=False, highlight=False)

    def advance(self, detail: str = "", units: int = 1) -> None:
        if self.progress is not None and self.task is not None:
            self.progress.update(self.task, advance=units, detail=detail)

    def note(self, message: str) -> None:
        if self.plain:
            self.err.print(f"[{self._clock()}] {message}", markup=False, highlight=False)

    def warn(self, message: str) -> None:
        target = self.progress.console if self.progress is not None else self.err
        target.print(f"warning: {message}", style="yellow", markup=False, highlight=False)

    def _clock(self) -> str:
        return seconds(time.perf_counter() - self.started)


def _progress(err: Console) -> Progress:
    return Progress(SpinnerColumn(), TextColumn("[bold]{task.description:<8}"), BarColumn(),
                    MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                    TextColumn("[dim]{task.fields[detail]}"), console=err, transient=True)


# --- configuration --------------------------------------------------------------------------------------

def _random_lengths(context_length: int) -> tuple[int, ...]:
    from s4r.bench.runner import RANDOM_WEIGHTS_LENGTHS

    fitting = tuple(n for n in RANDOM_WEIGHTS_LENGTHS if n <= context_length)
    return fitting or (context_length,)


def build_config(*, quick: bool, methods: tuple[str, ...] | None, ratios: tuple[float, ...] | None,
                 lengths: tuple[int, ...] | None, tasks: tuple[str, ...] | None, samples: int | None,
                 seed: int, speed_only: bool, accuracy_only: bool, max_new_tokens: int | None,
                 random_context: int | None, book: str | None = None,
                 method_ratios: dict[str, tuple[float, ...]] | None = None) -> BenchConfig:
    """The runner's config from the options: the full or quick preset, then what was given explicitly.

    `random_context` is the context length of a random-weight profile (speed only, long lengths).
    """
    from s4r.bench.runner import BenchConfig

    cfg = BenchConfig.quick_preset() if quick else BenchConfig()
    changes: dict[str, Any] = {"seed": seed}
    if methods is not None:
        changes["methods"] = methods
    if ratios is not None:
        changes["ratios"] = ratios
    if lengths is not None:
        # perplexity follows the given lengths (those >= 4k, else the longest)
        changes["lengths"], changes["perplexity_lengths"] = lengths, None
    elif random_context is not None:
        changes["lengths"], changes["perplexity_lengths"] = _random_lengths(random_context), None
    if tasks is not None:
        changes["tasks"] = tasks
    if samples is not None:
        changes["samples"] = samples
    if max_new_tokens is not None:
        changes["max_new_tokens"] = max_new_tokens
    if book is not None:
        changes["book"] = book
    if method_ratios:
        changes["method_ratios"] = method_ratios
    if speed_only or random_context is not None:
        changes.update(accuracy=False, perplexity=False, speed=True)
    if accuracy_only:
        changes.update(accuracy=True, perplexity=False, speed=False)
    return replace(cfg, **changes)


def _check_random_fits(model: str, device: str, dtype: str, cfg: BenchConfig) -> None:
    """Before building a random-weight model: refuse lengths whose weights + caches cannot fit."""
    from s4r.bench.runner import LENGTH_MARGIN
    from s4r.bench.speed import check_lengths_fit, param_count
    from s4r.budget import KVShape
    from s4r.device import resolve_device, resolve_dtype
    from s4r.profiles import load_profile
    from s4r.random_model import build_config as arch_config
    from s4r.session import ANSWER_HEADROOM

    profile = load_profile(model)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    import torch

    nbytes = torch.empty(0, dtype=dt).element_size()
    shape = KVShape.from_config(arch_config(profile.architecture), nbytes)
    limit = profile.context_length - ANSWER_HEADROOM - 64 - LENGTH_MARGIN
    lengths = [min(n, limit) for n in cfg.context_lengths()]
    ratios = [float(r) for m in cfg.methods if m != "full" for r in cfg.ratios]
    check_lengths_fit(shape, lengths, ratios, device=dev, chunk_size=cfg.chunk_size,
                      weights=param_count(profile.architecture) * nbytes)


# --- output ---------------------------------------------------------------------------------------------

def _command_line() -> str:
    return "s4r " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def _print_tables(ui: UI, doc: dict[str, Any]) -> None:
    from s4r.bench.report import tables

    for table in tables(doc):
        ui.table(table.title, table.columns, table.rows)


def _summary_line(result: BenchResult) -> str:
    line = f"done in {seconds(result.wall_seconds)} · peak RSS {gib(result.peak_rss_bytes)}"
    if result.cuda_peak_bytes:
        line += f" · CUDA peak {gib(result.cuda_peak_bytes)}"
    return line


def _write_outputs(doc: dict[str, Any], json_path: Path | None, plot_path: Path | None, err: Console) -> None:
    from s4r.bench.report import plot, write_json

    if json_path is not None:
        write_json(doc, json_path)
        err.print(f"wrote {json_path}", markup=False, highlight=False)
    if plot_path is not None:
        try:
            plot(doc, plot_path)
        except ValueError as exc:  # nothing plottable (e.g. an interrupted run)
            err.print(f"no plot: {exc}", style="yellow", markup=False, highlight=False)
        else:
            err.print(f"wrote {plot_path}", markup=False, highlight=False)


# --- the command ----------------------------------------------------------------------------------------

def bench(
    quick: Annotated[bool, typer.Option(
        "--quick", rich_help_panel=_RUN,
        help="Smoke test (minutes on a laptop CPU): 2k tokens, one sample of three tasks, every method but "
             "kvzip, ratios 2.5 and 5, a short perplexity continuation.")] = False,
    model: ModelOpt = DEFAULT_MODEL,
    methods: Annotated[str | None, typer.Option(
        "--methods", rich_help_panel=_RUN, show_default=False,
        help="Comma-separated methods (default: full,s4r,s4r-paper,streaming,snapkv,svd,offline,quant,"
             "kvzip); full always runs as the reference. name@ratio runs a method at that ratio only, e.g. "
             "s4r@2.5,s4r@5,quant@5,kvzip@5.")] = None,
    ratios: Annotated[str | None, typer.Option(
        "--ratios", rich_help_panel=_RUN, show_default=False,
        help="Comma-separated compression ratios (default: 2.5,5).")] = None,
    lengths: Annotated[str | None, typer.Option(
        "--lengths", rich_help_panel=_RUN, show_default=False,
        help="Comma-separated context lengths, k = 1024 (default: 2k,4k,8k; --quick 2k; --random-weights "
             "32k,64k,128k). Perplexity runs at those >= 4k (else the longest).")] = None,
    tasks: Annotated[str | None, typer.Option(
        "--tasks", rich_help_panel=_RUN, show_default=False,
        help="Comma-separated accuracy tasks, `needles` (the book needle tasks that tune the defaults), "
             "or all (default: all; --quick: niah_single_noise, niah_multikey, variable_tracking).")] = None,
    book: Annotated[str | None, typer.Option(
        "--book", rich_help_panel=_RUN, show_default=False,
        help="Haystack of the book tasks: pride-and-prejudice (tuning, the default) or romeo-and-juliet "
             "(held out: report figures on it).")] = None,
    samples: Annotated[int | None, typer.Option(
        "--samples", "-n", rich_help_panel=_RUN, show_default=False, min=1,
        help="Samples per task and length (default: 5; --quick 1).")] = None,
    seed: Annotated[int, typer.Option("--seed", rich_help_panel=_RUN, min=0,
                                      help="Seed of the generated samples.")] = 0,
    max_new_tokens: Annotated[int | None, typer.Option(
        "--max-new-tokens", rich_help_panel=_RUN, show_default=False, min=1,
        help="Most tokens per answer; each sample gets what its reference answer needs, up to this "
             "(default: 32; --quick 16).")] = None,
    speed_only: Annotated[bool, typer.Option(
        "--speed-only", rich_help_panel=_RUN,
        help="Only speed and memory (no accuracy, no perplexity).")] = False,
    accuracy_only: Annotated[bool, typer.Option(
        "--accuracy-only", rich_help_panel=_RUN, help="Only the accuracy tasks.")] = False,
    random_weights: Annotated[bool, typer.Option(
        "--random-weights", rich_help_panel=_RUN,
        help="Build the profile's shape with random weights (no download): speed and memory only, at long "
             "lengths (meant for a GPU; on CPU lengths that cannot fit are refused).")] = False,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = Dtype.auto,
    threads: Annotated[int | None, typer.Option(
        "--threads", rich_help_panel=_RUN, show_default=False, min=1,
        help="CPU threads for torch (default: the cores other processes leave free, at least 1; "
             "torch's own choice when OMP_NUM_THREADS is set). Too many threads on a busy machine can be "
             "ten times slower.")] = None,
    json_path: Annotated[str | None, typer.Option(
        "--json", rich_help_panel=_OUT, show_default=False, metavar="PATH",
        help="Write every measurement as JSON (structure: see s4r/bench/report.py).")] = None,
    plot_path: Annotated[str | None, typer.Option(
        "--plot", rich_help_panel=_OUT, show_default=False, metavar="PATH.png",
        help="Save a figure: accuracy against ratio per method, decode tok/s against length.")] = None,
) -> None:
    # every option is checked before the model loads, so a typo fails in milliseconds
    if speed_only and accuracy_only:
        raise UsageError("--speed-only and --accuracy-only exclude each other")
    if random_weights:
        if accuracy_only:
            raise UsageError("--random-weights measures speed and memory only; it cannot run --accuracy-only")
        from s4r.profiles import profile_names

        if model not in profile_names():
            raise UsageError(f"--random-weights needs a profile name (see `s4r models`), got '{model}'")
    else:
        check_model_spec(model)
    device = check_device(device)
    json_file = _check_output(json_path, "--json")
    plot_file = _check_output(plot_path, "--plot")
    _check_plot(plot_file)
    parsed = {"methods": parse_methods(methods), "ratios": parse_ratios(ratios),
              "lengths": parse_length_list(lengths), "tasks": parse_tasks(tasks), "book": parse_book(book),
              "method_ratios": parse_method_ratios(methods)}

    import torch

    from s4r.bench.report import to_json
    from s4r.bench.runner import BenchRunner
    from s4r.errors import S4RError
    from s4r.loading import load_model, resolve_device
    from s4r.threads import apply_threads

    dev = resolve_device(device)  # `--device cuda` without a GPU fails before any loading
    apply_threads(threads, dev.type)  # the policy every command shares (s4r/threads.py)
    random_context = None
    if random_weights:
        from s4r.profiles import load_profile

        random_context = load_profile(model).context_length
    cfg = build_config(quick=quick, samples=samples, seed=seed, speed_only=speed_only,
                       accuracy_only=accuracy_only, max_new_tokens=max_new_tokens,
                       random_context=random_context, **parsed)
    try:
        cfg.validate()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    err = Console(file=sys.stderr, highlight=False, soft_wrap=True)
    if random_weights:
        _check_random_fits(model, device, dtype.value, cfg)
        if dev.type == "cpu" and max(cfg.context_lengths()) > 16384:
            err.print("warning: --random-weights on CPU: prefilling tens of thousands of tokens takes hours "
                      "here; it is meant for a GPU", style="yellow", markup=False, highlight=False)

    # a pipe or file gets the tables at full width: a log is read in an editor, not an 80-column terminal
    out = Console(file=sys.stdout, highlight=False, width=None if is_tty(sys.stdout) else 200)
    bars = is_tty(sys.stderr)
    ui = UI(out=sys.stdout, info=out, progress=err if bars else None)
    with ui.loading(model) as load_progress:
        loaded = load_model(model, device=device, dtype=dtype.value, random_weights=random_weights,
                            progress=load_progress)
    err.print(f"model {loaded.name} on {loaded.device} ({str(loaded.dtype).removeprefix('torch.')}), "
              f"{torch.get_num_threads()} threads", markup=False, highlight=False)

    progress = _progress(err) if bars else None
    hooks = _Hooks(err, progress)
    runner = BenchRunner(loaded, cfg, hooks, random_weights=random_weights)
    command = _command_line()
    try:
        if progress is not None:
            with progress:
                result = runner.run()
        else:
            result = runner.run()
    except KeyboardInterrupt:
        # keep what was measured: an hour of benchmark should not vanish with one Ctrl-C
        if json_file is not None and (runner.result.accuracy or runner.result.contexts):
            _write_outputs(to_json(runner.result, command), json_file, None, err)
            err.print("interrupted: partial results written", style="yellow", markup=False, highlight=False)
        raise

    doc = to_json(result, command)
    with pipe_guard():
        _print_tables(ui, doc)
        out.print(_summary_line(result), style="dim", markup=False, highlight=False)
    _write_outputs(doc, json_file, plot_file, err)
    failures = result.errors()
    if failures:
        raise S4RError(f"{len(failures)} benchmark run(s) failed (see 'Skipped and failed runs' above"
                       + (f" and 'issues' in {json_file}" if json_file else "") + ")")


def register(app: typer.Typer) -> None:
    """Add `s4r bench` to the CLI app."""
    short = "Benchmark accuracy, perplexity, speed and memory."
    app.command(name="bench", help=HELP, short_help=short)(bench)
