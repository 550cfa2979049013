"""Options shared by `s4r chat` and `s4r ask`, input reading/validation, and model/session setup.

Everything a user can get wrong on the command line is checked here *before* the model is loaded, so
bad input fails instantly with one line instead of after seconds of loading.
"""

from __future__ import annotations

import codecs
import math
import re
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import IO, TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:  # the library imports torch; keep `s4r --help` and input errors fast
    from s4r.session import IngestStats, Session
    from s4r_cli.ui import UI

DEFAULT_MODEL = "smollm2-135m"
# Refuse bigger documents up front: even the longest-context models hold far less than this.
MAX_DOCUMENT_BYTES = 256 * 1024 * 1024
MAX_RATIO = 1000.0
# mirrors s4r.loading.ROPE_SCALING_MAX (not imported: that module loads torch)
MAX_ROPE_SCALING = 8.0
# Enough to tell text from binary; the same window `grep` and `git` look at.
BINARY_SNIFF_BYTES = 8192
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
    """Choices for --truncate: which part of an over-long document to keep."""

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
MethodOpt = Annotated[str, typer.Option(
    "--method", rich_help_panel=_CACHE, help="s4r (compressed cache) or full (uncompressed baseline).")]
TruncateOpt = Annotated[Truncate | None, typer.Option(
    "--truncate", case_sensitive=False, rich_help_panel=_CACHE,
    help="If a document is longer than the context, keep its head, tail or middle (default: refuse).")]
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
SystemOpt = Annotated[str | None, typer.Option("--system", rich_help_panel=_GEN, help="System prompt.")]
FileOpt = Annotated[list[str] | None, typer.Option(
    "--file", "-f", rich_help_panel=_INPUT, show_default=False,
    help="A UTF-8 text document to read (repeatable; `-` is stdin).")]
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

    def validate(self) -> None:
        """Raise UsageError if any value is out of range."""
        check_max_new_tokens(self.max_new_tokens)
        check_temperature(self.temperature)
        check_top_p(self.top_p)
        check_seed(self.seed)

    def describe(self) -> str:
        """One line for /set and /stats."""
        seed = self.seed if self.seed is not None else "none"
        return (f"temperature {self.temperature:g}, top_p {self.top_p:g}, max_tokens {self.max_new_tokens}, "
                f"seed {seed}")

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments for Session.ask."""
        return {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
                "top_p": self.top_p, "seed": self.seed}

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
        else:
            raise UsageError(f"unknown setting '{key}'; settable: temperature, top_p, max_tokens, seed")
        return key


SET_ALIASES = {"temp": "temperature", "topp": "top_p", "max_tokens": "max_new_tokens",
               "max_new_tokens": "max_new_tokens", "maxtokens": "max_new_tokens"}


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


# -- documents ---------------------------------------------------------------------------------------------

@dataclass
class Document:
    """A validated text document ready to ingest."""

    name: str
    text: str


def decode_document(data: bytes, name: str) -> str:
    """Bytes -> text, or UsageError naming what is wrong (empty, binary, not UTF-8)."""
    if not data.strip():
        raise UsageError(f"{name} is empty" if not data else f"{name} contains only whitespace")
    # UTF-16 has NUL bytes by nature; with a BOM it is unambiguous, so accept it instead of calling it binary.
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        try:
            text = data.decode("utf-16")
        except UnicodeDecodeError as e:
            raise UsageError(f"{name} starts with a UTF-16 mark but is not UTF-16 ({e.reason})") from None
    else:
        if b"\x00" in data[:BINARY_SNIFF_BYTES]:
            raise UsageError(f"{name} looks like a binary file (NUL bytes in its first 8 KiB); pass text")
        try:
            text = data.decode("utf-8-sig")  # -sig: drop the BOM some editors (and Gutenberg) write
        except UnicodeDecodeError as e:
            src = "the input" if name == "<stdin>" else name
            raise UsageError(
                f"{name} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}: {e.reason}); "
                f"convert it first, e.g. iconv -f latin1 -t utf-8 {src} > converted.txt") from None
    text = text.replace("\r\n", "\n")
    if not text.strip():
        raise UsageError(f"{name} contains only whitespace")
    return text


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def read_document_file(path: str) -> Document:
    """Read and validate one document file; every failure is a one-line UsageError."""
    p = Path(path).expanduser()
    try:
        st = p.stat()
    except FileNotFoundError:
        raise UsageError(f"file not found: {path}") from None
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror or e}") from None
    if p.is_dir():
        raise UsageError(f"{path} is a directory, not a text file")
    if st.st_size > MAX_DOCUMENT_BYTES:
        raise UsageError(f"{path} is {_mib(st.st_size)}; the limit is {_mib(MAX_DOCUMENT_BYTES)} "
                         "(pass an excerpt instead)")
    try:
        data = p.read_bytes()
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror or e}") from None
    return Document(name=path, text=decode_document(data, path))


def read_document_stream(stream: IO[bytes], name: str = "<stdin>") -> Document:
    """Read a document from a binary stream (stdin), refusing more than MAX_DOCUMENT_BYTES."""
    data = stream.read(MAX_DOCUMENT_BYTES + 1)
    if len(data) > MAX_DOCUMENT_BYTES:
        raise UsageError(f"{name} is more than {_mib(MAX_DOCUMENT_BYTES)}; pass an excerpt instead")
    if not data:
        raise UsageError(f"{name} is empty; pipe a document in or pass --file FILE")
    return Document(name=name, text=decode_document(data, name))


def read_documents(files: Sequence[str], *, stdin: IO[bytes] | None = None) -> list[Document]:
    """Read every --file (``-`` means stdin) in order. Validates all before returning any."""
    docs = []
    for f in files:
        if f == "-":
            if stdin is None:
                raise UsageError("--file - needs a document on stdin")
            docs.append(read_document_stream(stdin))
        else:
            docs.append(read_document_file(f))
    return docs


def stdin_bytes() -> IO[bytes] | None:
    """Binary stdin when something is piped in, None when stdin is a terminal or closed."""
    s = sys.stdin
    if s is None or s.closed:
        return None
    try:
        if s.isatty():
            return None
    except (OSError, ValueError):
        return None
    return s.buffer


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
    load: str | None = None
    generation: GenerationSettings = field(default_factory=GenerationSettings)
    # session options the user typed; a saved cache keeps its own settings for the rest
    explicit: frozenset[str] = frozenset()

    def validate(self) -> None:
        """Cheap option checks (no file or model access)."""
        check_ratio(self.ratio)
        check_rope_scaling(self.rope_scaling)
        self.device = check_device(self.device)
        self.generation.validate()
        if self.load and self.files:
            raise UsageError("--load and --file cannot be combined; /read adds documents after loading")

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
                seed: int | None, rope_scaling: float | None = None,
                ingest: Ingest = Ingest.layerwise) -> CommonArgs:
    """Bundle the shared options of a command into a validated CommonArgs."""
    explicit = {name for name in ("method", "ratio", "system", "truncate", "ingest")
                if (src := ctx.get_parameter_source(name)) is not None and src.name != "DEFAULT"}
    args = CommonArgs(model=model, device=device, dtype=dtype, quant=quant, ratio=ratio, method=method,
                      truncate=truncate, rope_scaling=rope_scaling, system=system, files=list(files or []),
                      load=load, ingest=ingest,
                      generation=GenerationSettings(max_new_tokens, temperature, top_p, seed),
                      explicit=frozenset(explicit))
    args.validate()
    return args


def load_model(args: CommonArgs, ui: UI) -> Any:
    """Check the device, then load the model with a progress display. Returns the LoadedModel.

    With --rope-scaling, one warning line on stderr says how far the context now reaches.
    """
    from s4r.loading import load_model as _load_model
    from s4r.loading import resolve_device

    resolve_device(args.device)  # fail fast on `--device cuda` without a GPU, before any download/IO
    with ui.loading(args.model) as progress:
        loaded = _load_model(args.model, device=args.device, dtype=args.dtype.value, quant=args.quant.value,
                             progress=progress, rope_scaling=args.rope_scaling)
    if args.rope_scaling is not None:
        sys.stderr.write(f"s4r: warning: RoPE scaling x{args.rope_scaling:g} extends the context to "
                         f"{loaded.context_length:,} tokens; answer quality may drop\n")
        sys.stderr.flush()
    return loaded


def ingest(session: Session, doc: Document, ui: UI) -> IngestStats:
    """Add one document to the session with a progress bar."""
    with ui.ingesting(doc.name) as progress:
        return session.ingest(doc.text, name=doc.name, progress=progress)


def open_session(args: CommonArgs, loaded: Any, docs: Sequence[Document], ui: UI) -> tuple[Session, float]:
    """Create the session (fresh or from --load), ingest the documents; return (session, ingest seconds)."""
    from s4r.session import Session

    if args.load:
        session = Session.load(args.load, loaded, **args.session_kwargs(only_explicit=True))
    else:
        session = Session(loaded, **args.session_kwargs())
    seconds = 0.0
    for doc in docs:
        seconds += ingest(session, doc, ui).seconds
    return session, seconds
