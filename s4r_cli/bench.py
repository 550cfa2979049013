"""`s4r bench`: accuracy, perplexity gap, speed and memory of every KV-cache method, side by side.

The measuring is `s4r.bench.runner`; this module parses options, shows progress (bars on a terminal,
plain lines otherwise), prints the summary tables and writes `--json` / `--plot`.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

from s4r.units import gib
from s4r_cli.bench_options import (
    build_config,
    check_output,
    check_plot,
    check_random_fits,
    parse_book,
    parse_length_list,
    parse_method_ratios,
    parse_methods,
    parse_ratios,
    parse_tasks,
)
from s4r_cli.bench_progress import BenchProgress, progress_bars
from s4r_cli.checks import check_device, check_model_spec
from s4r_cli.cli_errors import UsageError, pipe_guard
from s4r_cli.options import METHODS_PLACEHOLDER, ModelOptions, with_options
from s4r_cli.ui import UI, is_tty, seconds

if TYPE_CHECKING:  # the library imports torch; keep `s4r bench --help` and option errors fast
    from s4r.bench.records import BenchResult

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


# --- output ---------------------------------------------------------------------------------------------

def _command_line() -> str:
    return "s4r " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def _print_tables(ui: UI, doc: dict[str, Any]) -> None:
    from s4r.bench.report_tables import tables

    for table in tables(doc):
        ui.table(table.title, table.columns, table.rows)


def _summary_line(result: BenchResult) -> str:
    line = f"done in {seconds(result.wall_seconds)} · peak RSS {gib(result.peak_rss_bytes)}"
    if result.cuda_peak_bytes:
        line += f" · CUDA peak {gib(result.cuda_peak_bytes)}"
    return line


def _write_outputs(doc: dict[str, Any], json_path: Path | None, plot_path: Path | None, err: Console) -> None:
    from s4r.bench.report import write_json
    from s4r.bench.report_plot import plot

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
    models: ModelOptions,
    quick: Annotated[bool, typer.Option(
        "--quick", rich_help_panel=_RUN,
        help="Smoke test (minutes on a laptop CPU): 2k tokens, one sample of three tasks, every method but "
             "kvzip, ratios 2.5 and 5, a short perplexity continuation.")] = False,
    methods: Annotated[str | None, typer.Option(
        "--methods", rich_help_panel=_RUN, show_default=False,
        help=f"Comma-separated methods (default: every one of {METHODS_PLACEHOLDER}); full always runs as "
             "the reference. name@ratio runs a method at that ratio only, e.g. "
             "s4r@2.5,s4r@5,quant@5,kvzip@5.")]
    = None,
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
    json_path: Annotated[str | None, typer.Option(
        "--json", rich_help_panel=_OUT, show_default=False, metavar="PATH",
        help="Write every measurement as JSON (structure: see s4r/bench/report.py).")] = None,
    plot_path: Annotated[str | None, typer.Option(
        "--plot", rich_help_panel=_OUT, show_default=False, metavar="PATH.png",
        help="Save a figure: accuracy against ratio per method, decode tok/s against length.")] = None,
) -> None:
    # every option is checked before the model loads, so a typo fails in milliseconds
    model, dtype, threads = models.model, models.dtype, models.threads
    if speed_only and accuracy_only:
        raise UsageError("--speed-only and --accuracy-only exclude each other")
    if random_weights:
        if accuracy_only:
            raise UsageError("--random-weights measures speed and memory only; it cannot run --accuracy-only")
        from s4r.models.profiles import profile_names

        if model not in profile_names():
            raise UsageError(f"--random-weights needs a profile name (see `s4r models`), got '{model}'")
    else:
        check_model_spec(model)
    device = check_device(models.device)
    json_file = check_output(json_path, "--json")
    plot_file = check_output(plot_path, "--plot")
    check_plot(plot_file)
    parsed = {"methods": parse_methods(methods), "ratios": parse_ratios(ratios),
              "lengths": parse_length_list(lengths), "tasks": parse_tasks(tasks), "book": parse_book(book),
              "method_ratios": parse_method_ratios(methods)}

    import torch

    from s4r.bench.report import to_json
    from s4r.bench.runner import BenchRunner
    from s4r.errors import S4RError
    from s4r.models.loading import load_model, resolve_device
    from s4r.runtime.threads import apply_threads

    dev = resolve_device(device)  # `--device cuda` without a GPU fails before any loading
    apply_threads(threads, dev.type)  # the policy every command shares (s4r/runtime/threads.py)
    random_context = None
    if random_weights:
        from s4r.models.profiles import load_profile

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
        check_random_fits(model, device, dtype.value, cfg)
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

    progress = progress_bars(err) if bars else None
    hooks = BenchProgress(err, progress)
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
    app.command(name="bench", help=HELP, short_help=short)(with_options(bench))
