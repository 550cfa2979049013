"""`s4r bench` options: parsed and checked before the model loads, so a typo fails in milliseconds; then
turned into the runner's BenchConfig."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from s4r_cli.checks import check_ratio
from s4r_cli.cli_errors import UsageError

if TYPE_CHECKING:  # the library imports torch; keep `s4r bench --help` and option errors fast
    from s4r.bench.config import BenchConfig


def _split(text: str | None) -> list[str]:
    return [p.strip() for p in (text or "").replace(";", ",").split(",") if p.strip()]


def parse_methods(text: str | None) -> tuple[str, ...] | None:
    """Comma-separated method names; a name the registry (s4r.methods.METHODS) lacks is a usage error.

    A registered method this machine cannot build is left to the runner, which skips it with a warning.
    `name@ratio` runs that method at that ratio only (see parse_method_ratios).
    """
    from s4r.methods import METHODS

    names = [n.split("@", 1)[0].strip() for n in _split(text)]
    if text is not None and not names:
        raise UsageError("--methods needs at least one method name")
    known = set(METHODS)
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
    from s4r.bench.config import parse_lengths

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


def check_output(path: str | None, option: str) -> Path | None:
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


def check_plot(path: Path | None) -> None:
    """--plot needs matplotlib and a file type it writes."""
    if path is None:
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 's4r[plot]'") from None
    supported = {".png", ".pdf", ".svg", ".jpg", ".jpeg"}
    if path.suffix.lower() not in supported:
        raise UsageError(f"--plot {path}: use one of {', '.join(sorted(supported))}")


# --- configuration -----------------------------------------------------------------------------------

def _random_lengths(context_length: int) -> tuple[int, ...]:
    from s4r.bench.config import RANDOM_WEIGHTS_LENGTHS

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
    from s4r.bench.config import BenchConfig

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


def check_random_fits(model: str, device: str, dtype: str, cfg: BenchConfig) -> None:
    """Before building a random-weight model: refuse lengths whose weights + caches cannot fit."""
    from s4r.bench.config import LENGTH_MARGIN
    from s4r.bench.speed import check_lengths_fit, param_count
    from s4r.core.budget import KVShape
    from s4r.models.device import resolve_device, resolve_dtype
    from s4r.models.profiles import load_profile
    from s4r.models.random_model import build_config as arch_config
    from s4r.runtime.session import ANSWER_HEADROOM

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


