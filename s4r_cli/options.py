"""The command-line options `s4r chat`, `s4r ask` and `s4r bench` share, declared once.

Each option is an ``Annotated`` type carrying its typer declaration; :class:`ModelOptions` (every command
that loads a model) and :class:`CommonArgs` (chat and ask) gather them into dataclasses. A command takes
such a dataclass as one parameter and :func:`with_options` turns its fields into the command's options,
then hands the command one instance built from what was typed, so the options are passed whole.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Annotated, Any, TypeVar, get_type_hints

import typer

from s4r_cli.checks import check_device, check_ratio, check_rope_scaling
from s4r_cli.cli_errors import UsageError
from s4r_cli.generation_settings import GenerationSettings

DEFAULT_MODEL = "smollm2-135m"
# options of a session that a saved cache keeps unless the user types them again
SESSION_OPTIONS = ("method", "ratio", "system", "truncate", "ingest", "hidden_spill")


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


class HiddenSpill(str, Enum):
    """Choices for --hidden-spill: where a layer-wise ingest keeps the text's hidden states between
    layers."""

    auto = "auto"
    on = "on"
    off = "off"


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
# stands for the registered methods until help is shown (app.fill_method_help puts the list in)
METHODS_PLACEHOLDER = "s4r, full, …"
MethodOpt = Annotated[str, typer.Option(
    "--method", rich_help_panel=_CACHE,
    help=f"The KV-cache method: {METHODS_PLACEHOLDER}. s4r compresses; full is the uncompressed reference.")]
TruncateOpt = Annotated[Truncate | None, typer.Option(
    "--truncate", case_sensitive=False, rich_help_panel=_CACHE,
    help="If a document is longer than the context: head keeps its start, tail its end, middle cuts out "
         "the middle and keeps both ends. Default: refuse (exit 2).")]
IngestOpt = Annotated[Ingest, typer.Option(
    "--ingest", case_sensitive=False, rich_help_panel=_CACHE,
    help="layerwise: one model layer at a time, each compressed when done (never the full cache; "
         "chunked where it cannot apply); chunked: the whole model per chunk, compressed at the end.")]
HiddenSpillOpt = Annotated[HiddenSpill, typer.Option(
    "--hidden-spill", case_sensitive=False, rich_help_panel=_CACHE,
    help="layerwise ingest: keep the text's hidden states in a temporary file between layers (on), in "
         "memory (off), or in a file for long texts on CPU when the temp dir is a disk (auto).")]
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
         "torch's own choice when OMP_NUM_THREADS is set). Too many threads on a busy machine can be "
         "ten times slower.")]
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
class ModelOptions:
    """Which model and where it runs: the options of every command that loads one."""

    model: ModelOpt = DEFAULT_MODEL
    device: DeviceOpt = "auto"
    dtype: DtypeOpt = Dtype.auto
    threads: ThreadsOpt = None


@dataclass
class CommonArgs(ModelOptions):
    """Everything `chat` and `ask` share: model, documents, cache method, generation; see :meth:`validate`."""

    quant: QuantOpt = Quant.none
    rope_scaling: RopeScalingOpt = None
    files: FileOpt = None
    books: BookOpt = None
    load: LoadOpt = None
    ratio: RatioOpt = 5.0
    method: MethodOpt = "s4r"
    truncate: TruncateOpt = None
    ingest: IngestOpt = Ingest.layerwise
    hidden_spill: HiddenSpillOpt = HiddenSpill.auto
    system: SystemOpt = None
    max_new_tokens: MaxNewTokensOpt = 512
    temperature: TemperatureOpt = 0.0
    top_p: TopPOpt = 1.0
    seed: SeedOpt = None
    repeat_penalty: RepeatPenaltyOpt = 1.1
    loop_guard: LoopGuardOpt = True
    # built from the fields above; the REPL's /set changes it between turns
    generation: GenerationSettings = field(init=False)
    # session options the user typed (see SESSION_OPTIONS); a saved cache keeps its own for the rest
    explicit: frozenset[str] = field(init=False, default=frozenset())

    def __post_init__(self) -> None:
        self.files = list(self.files or [])
        self.books = list(self.books or [])
        self.generation = GenerationSettings(self.max_new_tokens, self.temperature, self.top_p, self.seed,
                                             self.repeat_penalty, self.loop_guard)

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
                              "ingest": self.ingest.value, "hidden_spill": self.hidden_spill.value}
        if only_explicit:
            kw = {k: v for k, v in kw.items() if k in self.explicit}
        return kw


def common_args(ctx: typer.Context, args: CommonArgs) -> CommonArgs:
    """``args`` validated, with the session options the user typed noted (``explicit``)."""
    typed = {name for name in SESSION_OPTIONS
             if (src := ctx.get_parameter_source(name)) is not None and src.name != "DEFAULT"}
    args.explicit = frozenset(typed)
    args.validate()
    return args


Command = TypeVar("Command", bound=Callable[..., Any])


def with_options(command: Command) -> Command:
    """Let a typer command take option dataclasses (ModelOptions, CommonArgs) as parameters.

    Each such parameter is replaced by its dataclass's fields (``init=False`` ones left out) in the
    signature typer reads; at call time the fields' values are gathered back into one instance.
    """
    hints = get_type_hints(command, include_extras=True)
    plain: list[inspect.Parameter] = []
    expanded: list[inspect.Parameter] = []
    groups: dict[str, tuple[type, list[str]]] = {}
    for name, param in inspect.signature(command).parameters.items():
        kind = hints.get(name, param.annotation)
        if not (isinstance(kind, type) and dataclasses.is_dataclass(kind)):
            plain.append(param.replace(annotation=kind))
            continue
        field_hints = get_type_hints(kind, include_extras=True)
        fields = [f for f in dataclasses.fields(kind) if f.init]
        groups[name] = (kind, [f.name for f in fields])
        expanded += [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=field_hints[f.name],
                                       default=f.default) for f in fields]

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        for name, (kind, names) in groups.items():
            kwargs[name] = kind(**{n: kwargs.pop(n) for n in names})
        return command(*args, **kwargs)

    params = plain + expanded
    wrapper.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in params}
    return wrapper  # type: ignore[return-value]
