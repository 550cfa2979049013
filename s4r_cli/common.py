"""Options shared by `s4r chat` and `s4r ask` and their validation (documents: documents.py; model and
session setup: session_setup.py).

Everything a user can get wrong on the command line is checked here *before* the model is loaded, so
bad input fails instantly with one line instead of after seconds of loading.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:  # the library imports torch; keep `s4r --help` and input errors fast
    pass

DEFAULT_MODEL = "smollm2-135m"
MAX_RATIO = 1000.0
# mirrors s4r.loading.ROPE_SCALING_MAX (not imported: that module loads torch)
MAX_ROPE_SCALING = 8.0
HUB_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


class UsageError(Exception):
    """Bad options or bad input files: exit code 2, one line on stderr."""


class PipeClosed(Exception):
    """The reader of our stdout went away (``s4r ask ... | head``); not an error worth a message."""


@contextmanager
def pipe_guard() -> Iterator[None]:
    """Turn BrokenPipeError into PipeClosed so it reaches `app.run` (typer would swallow an OSError)."""
    try:
        yield
    except BrokenPipeError:
        raise PipeClosed() from None


class Dtype(str, Enum):
    """Choices for --dtype."""

    auto = "auto"
    bf16 = "bf16"
    fp16 = "fp16"
    fp32 = "fp32"


class Quant(str, Enum):
    """Choices for --quant."""

    none = "none"
    q8 = "8bit"
    q4 = "4bit"


class Truncate(str, Enum):
    """Choices for --truncate: head keeps the start, tail the end, middle cuts out the middle (keeps
    both ends)."""

    head = "head"
    tail = "tail"
    middle = "middle"


class Ingest(str, Enum):
    """Choices for --ingest: how documents are prefilled into the cache."""

    layerwise = "layerwise"
    chunked = "chunked"


# -- option declarations (used by both chat.py and ask.py so they are defined once) -----------------------

_MODEL = "Model"
_CACHE = "Compression"
_GEN = "Generation"
_INPUT = "Input"

ModelOpt = Annotated[str, typer.Option(
    "--model", "-m", rich_help_panel=_MODEL,
    help="Profile name (see `s4r models`), a Hugging Face model folder, a .gguf file or a hub id.")]
DeviceOpt = Annotated[str, typer.Option(
    "--device", rich_help_panel=_MODEL, help="auto, cpu, cuda or cuda:N.")]
DtypeOpt = Annotated[Dtype, typer.Option("--dtype", case_sensitive=False, rich_help_panel=_MODEL)]
QuantOpt = Annotated[Quant, typer.Option(
    "--quant", case_sensitive=False, rich_help_panel=_MODEL,
    help="Weight quantization with bitsandbytes (CUDA; CPU too with recent bitsandbytes).")]
RatioOpt = Annotated[float, typer.Option(
    "--ratio", "-r", rich_help_panel=_CACHE,
    help="KV-cache compression ratio: the cache is stored in 1/RATIO of its full size (1 to 1000).")]
# the list of methods is filled in from s4r.methods.METHODS when help is shown (app.fill_method_help):
# importing the library here would load torch for every command
METHOD_HELP = "The KV-cache method: {methods}. s4r compresses; full is the uncompressed reference."
MethodOpt = Annotated[str, typer.Option(
    "--method", rich_help_panel=_CACHE, help=METHOD_HELP.format(methods="s4r, full, …"))]
TruncateOpt = Annotated[Truncate | None, typer.Option(
    "--truncate", case_sensitive=False, rich_help_panel=_CACHE,
    help="If a document is longer than the context: head keeps its start, tail its end, middle cuts out "
         "the middle and keeps both ends. Default: refuse (exit 2).")]
IngestOpt = Annotated[Ingest, typer.Option(
    "--ingest", case_sensitive=False, rich_help_panel=_CACHE,
    help="layerwise: one model layer at a time, each compressed when done (never the full cache; "
         "chunked where it cannot apply); chunked: the whole model per chunk, compressed at the end.")]
RopeScalingOpt = Annotated[float | None, typer.Option(
    "--rope-scaling", metavar="FACTOR", rich_help_panel=_MODEL, show_default=False,
    help="Stretch the model's context FACTOR times (above 1, at most 8) by rescaling its RoPE; "
         "answer quality drops.")]
MaxNewTokensOpt = Annotated[int, typer.Option(
    "--max-new-tokens", "-n", rich_help_panel=_GEN, help="Most tokens per answer.")]
TemperatureOpt = Annotated[float, typer.Option(
    "--temperature", "-t", rich_help_panel=_GEN, help="Sampling temperature; 0 is greedy.")]
TopPOpt = Annotated[float, typer.Option("--top-p", rich_help_panel=_GEN, help="Nucleus sampling mass (0-1].")]
SeedOpt = Annotated[int | None, typer.Option("--seed", rich_help_panel=_GEN, help="Seed for sampling.")]
RepeatPenaltyOpt = Annotated[float, typer.Option(
    "--repeat-penalty", rich_help_panel=_GEN,
    help="Penalize tokens used in the last 64 tokens, as llama.cpp and ollama do; 1 turns it off.")]
LoopGuardOpt = Annotated[bool, typer.Option(
    "--loop-guard/--no-loop-guard", rich_help_panel=_GEN,
    help="Stop an answer that starts repeating itself (and say so on stderr).")]
ThreadsOpt = Annotated[int | None, typer.Option(
    "--threads", rich_help_panel=_MODEL, show_default=False, min=1,
    help="CPU threads for torch (default: the cores other processes leave free, at least 1; "
         "torch's own choice when OMP_NUM_THREADS is set).")]
SystemOpt = Annotated[str | None, typer.Option("--system", rich_help_panel=_GEN, help="System prompt.")]
FileOpt = Annotated[list[str] | None, typer.Option(
    "--file", "-f", rich_help_panel=_INPUT, show_default=False,
    help="A UTF-8 text document to read (repeatable; `-` is stdin).")]
BookOpt = Annotated[list[str] | None, typer.Option(
    "--book", "-b", rich_help_panel=_INPUT, show_default=False, metavar="NAME",
    help="A book shipped with s4r (`s4r books` lists them: pride-and-prejudice, romeo-and-juliet), read "
         "as clean prose: no Project Gutenberg header or license, no illustration captions (repeatable).")]
LoadOpt = Annotated[str | None, typer.Option(
    "--load", rich_help_panel=_INPUT, show_default=False,
    help="Start from a cache saved with /save instead of reading documents.")]


@dataclass
class GenerationSettings:
    """Per-answer generation knobs; the REPL's /set changes them between turns."""

    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    # like llama.cpp and ollama: 1.1 over the last 64 tokens (1 = off); the bench decodes without it
    repeat_penalty: float = 1.1
    loop_guard: bool = True

    def validate(self) -> None:
        """Raise UsageError if any value is out of range."""
        check_max_new_tokens(self.max_new_tokens)
        check_temperature(self.temperature)
        check_top_p(self.top_p)
        check_seed(self.seed)
        check_repeat_penalty(self.repeat_penalty)

    def describe(self) -> str:
        """One line for /set and /stats."""
        seed = self.seed if self.seed is not None else "none"
        return (f"temperature {self.temperature:g}, top_p {self.top_p:g}, max_tokens {self.max_new_tokens}, "
                f"seed {seed}, repeat_penalty {self.repeat_penalty:g}, "
                f"loop_guard {'on' if self.loop_guard else 'off'}")

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments for Session.ask."""
        return {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
                "top_p": self.top_p, "seed": self.seed, "repeat_penalty": self.repeat_penalty,
                "repeat_last_n": REPEAT_LAST_N, "loop_guard": self.loop_guard}

    def set(self, key: str, value: str) -> str:
        """Parse and apply `/set KEY VALUE`; return the canonical key. Raise UsageError when invalid."""
        key = SET_ALIASES.get(key.lower().replace("-", "_"), key)
        if key == "temperature":
            self.temperature = check_temperature(_parse_float(key, value))
        elif key == "top_p":
            self.top_p = check_top_p(_parse_float(key, value))
        elif key == "max_new_tokens":
            self.max_new_tokens = check_max_new_tokens(_parse_int(key, value))
        elif key == "seed":
            random = value.lower() in ("none", "off", "random")
            self.seed = None if random else check_seed(_parse_int(key, value))
        elif key == "repeat_penalty":
            self.repeat_penalty = check_repeat_penalty(_parse_float(key, value))
        elif key == "loop_guard":
            self.loop_guard = _parse_switch(key, value)
        else:
            raise UsageError(f"unknown setting '{key}'; settable: {SETTABLE}")
        return key


REPEAT_LAST_N = 64
MAX_REPEAT_PENALTY = 10.0
SETTABLE = "temperature, top_p, max_tokens, seed, repeat_penalty, loop_guard, truncate"
SET_ALIASES = {"temp": "temperature", "topp": "top_p", "max_tokens": "max_new_tokens",
               "max_new_tokens": "max_new_tokens", "maxtokens": "max_new_tokens",
               "repeat_penalty": "repeat_penalty", "penalty": "repeat_penalty", "loop_guard": "loop_guard"}


def _parse_switch(key: str, value: str) -> bool:
    v = value.lower()
    if v in ("on", "true", "yes", "1"):
        return True
    if v in ("off", "false", "no", "0"):
        return False
    raise UsageError(f"{key} must be on or off, got '{value}'")


def _parse_float(key: str, value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise UsageError(f"{key} must be a number, got '{value}'") from None


def _parse_int(key: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"{key} must be a whole number, got '{value}'") from None


def check_ratio(ratio: float) -> float:
    """Accept 1 <= ratio <= 1000 (1 means no compression); anything else is a usage error."""
    if not math.isfinite(ratio) or ratio < 1.0:
        raise UsageError(f"--ratio must be at least 1 (the cache keeps 1/RATIO of its size), got {ratio:g}")
    if ratio > MAX_RATIO:
        raise UsageError(f"--ratio {ratio:g} is absurdly high; use at most {MAX_RATIO:g}")
    return ratio


def check_temperature(t: float) -> float:
    """Temperature must be a finite number >= 0 (0 = greedy)."""
    if not math.isfinite(t) or t < 0:
        raise UsageError(f"temperature must be 0 (greedy) or positive, got {t:g}")
    return t


def check_top_p(p: float) -> float:
    """top_p must lie in (0, 1]."""
    if not math.isfinite(p) or not 0.0 < p <= 1.0:
        raise UsageError(f"top_p must be in (0, 1], got {p:g}")
    return p


def check_max_new_tokens(n: int) -> int:
    """At least one new token per answer."""
    if n < 1:
        raise UsageError(f"max new tokens must be at least 1, got {n}")
    return n


def check_seed(seed: int | None) -> int | None:
    """Seeds are non-negative integers (what torch.manual_seed accepts)."""
    if seed is not None and seed < 0:
        raise UsageError(f"seed must be 0 or positive, got {seed}")
    return seed


def check_repeat_penalty(p: float) -> float:
    """1 (off) up to MAX_REPEAT_PENALTY; below 1 would reward repetition."""
    if not math.isfinite(p) or not 1.0 <= p <= MAX_REPEAT_PENALTY:
        raise UsageError(f"repeat penalty must be between 1 (off) and {MAX_REPEAT_PENALTY:g}, got {p:g}")
    return p


def check_rope_scaling(factor: float | None) -> float | None:
    """--rope-scaling is absent, or a factor above 1 and at most MAX_ROPE_SCALING."""
    if factor is not None and (not math.isfinite(factor) or not 1.0 < factor <= MAX_ROPE_SCALING):
        raise UsageError(f"--rope-scaling must be above 1 and at most {MAX_ROPE_SCALING:g} "
                         f"(the factor the context grows by), got {factor:g}")
    return factor


def check_device(device: str) -> str:
    """Shape check only; whether the device exists is the library's call (DeviceError, exit 1)."""
    d = device.strip().lower()
    if d in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", d):
        return d
    raise UsageError(f"--device must be auto, cpu, cuda or cuda:N, got '{device}'")


def check_cache_path(path: str) -> Path:
    """A --load / /load path must be an existing file (missing file: usage error; bad contents: exit 1)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise UsageError(f"saved cache not found: {path}")
    if p.is_dir():
        raise UsageError(f"{path} is a directory, not a saved cache")
    return p


# -- model & session ---------------------------------------------------------------------------------------

def check_model_spec(spec: str) -> None:
    """Reject model specs that cannot be anything (usage error); leave real lookups to the loader.

    A profile name, an existing folder or .gguf, or a hub id (``org/name``) go on to ``load_model``,
    whose ModelLoadError is a runtime error (exit 1). A missing path or a bare unknown word is a typo,
    so it is a usage error (exit 2) reported before anything slow happens.
    """
    # mirrors s4r.loading.load_model's dispatch without importing it (torch makes that import slow)
    from s4r.profiles import profile_names

    if spec in profile_names():
        return
    p = Path(spec).expanduser()
    if p.exists():
        if p.is_dir() or p.suffix.lower() == ".gguf":
            return
        raise UsageError(f"--model {spec} is a file but not a .gguf; pass a model folder, .gguf or profile")
    looks_like_path = (spec.startswith((".", "/", "~")) or spec.lower().endswith(".gguf") or "\\" in spec
                       or spec.count("/") > 1)
    if looks_like_path:
        raise UsageError(f"model not found: {spec}")
    if HUB_ID_RE.fullmatch(spec):
        return
    raise UsageError(f"unknown model '{spec}'; run `s4r models` for the profiles, or pass a model folder, "
                     "a .gguf file or a hub id (org/name)")


def error_message(e: Exception) -> str:
    """One line for a library error; ContextTooLongError gets the ways out this CLI offers."""
    from s4r.errors import ContextTooLongError

    if isinstance(e, ContextTooLongError):
        return (f"the input is {e.tokens:,} tokens but the model's context is {e.limit:,} tokens; "
                "pass --truncate head|tail|middle to keep the part that fits, or --rope-scaling FACTOR to "
                "stretch the context (lower quality)")
    return " ".join((str(e) or type(e).__name__).split())


def method_label(session: Any) -> str:
    """'s4r (requested ×5)' or 'full (no compression)'."""
    if session.method == "full":
        return "full (no compression)"
    return f"{session.method} (requested ×{session.ratio_requested:g})"


def check_method(method: str) -> str:
    """--method must be one the library knows (it may add methods, e.g. for benchmarks)."""
    from s4r.session import METHODS as methods

    if method not in methods:
        raise UsageError(f"--method must be one of {', '.join(methods)}, got '{method}'")
    return method


@dataclass
class CommonArgs:
    """The options chat and ask share, validated by :meth:`validate`."""

    model: str = DEFAULT_MODEL
    device: str = "auto"
    dtype: Dtype = Dtype.auto
    quant: Quant = Quant.none
    ratio: float = 5.0
    method: str = "s4r"
    truncate: Truncate | None = None
    rope_scaling: float | None = None
    ingest: Ingest = Ingest.layerwise
    system: str | None = None
    files: list[str] = field(default_factory=list)
    books: list[str] = field(default_factory=list)
    load: str | None = None
    threads: int | None = None
    generation: GenerationSettings = field(default_factory=GenerationSettings)
    # session options the user typed; a saved cache keeps its own settings for the rest
    explicit: frozenset[str] = frozenset()

    def validate(self) -> None:
        """Cheap option checks (no file or model access)."""
        check_ratio(self.ratio)
        check_rope_scaling(self.rope_scaling)
        self.device = check_device(self.device)
        self.generation.validate()
        if self.load and (self.files or self.books):
            raise UsageError("--load cannot be combined with --file or --book; /read adds documents after "
                             "loading")

    def session_kwargs(self, *, only_explicit: bool = False) -> dict[str, Any]:
        """Keyword arguments for Session(...) / Session.load(...)."""
        kw: dict[str, Any] = {"method": self.method, "ratio": self.ratio, "system": self.system,
                              "truncate": self.truncate.value if self.truncate else None,
                              "ingest": self.ingest.value}
        if only_explicit:
            kw = {k: v for k, v in kw.items() if k in self.explicit}
        return kw


def common_args(ctx: typer.Context, *, model: str, device: str, dtype: Dtype, quant: Quant, ratio: float,
                method: str, truncate: Truncate | None, system: str | None, files: list[str] | None,
                load: str | None, max_new_tokens: int, temperature: float, top_p: float,
                seed: int | None, rope_scaling: float | None = None, books: list[str] | None = None,
                threads: int | None = None, repeat_penalty: float = 1.1,
                loop_guard: bool = True, ingest: Ingest = Ingest.layerwise) -> CommonArgs:
    """Bundle the shared options of a command into a validated CommonArgs."""
    explicit = {name for name in ("method", "ratio", "system", "truncate", "ingest")
                if (src := ctx.get_parameter_source(name)) is not None and src.name != "DEFAULT"}
    args = CommonArgs(model=model, device=device, dtype=dtype, quant=quant, ratio=ratio, method=method,
                      truncate=truncate, rope_scaling=rope_scaling, system=system, files=list(files or []),
                      books=list(books or []), load=load, threads=threads, ingest=ingest,
                      generation=GenerationSettings(max_new_tokens, temperature, top_p, seed, repeat_penalty,
                                                    loop_guard),
                      explicit=frozenset(explicit))
    args.validate()
    return args
