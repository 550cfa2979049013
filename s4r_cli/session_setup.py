"""Loading the model and opening the session for `chat` and `ask`: threads, device, ratio checks, ingest
with its one-line notices (truncation, an uncompressed cache)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from s4r_cli.cli_errors import UsageError, error_message
from s4r_cli.documents import Document
from s4r_cli.options import CommonArgs

if TYPE_CHECKING:  # the library imports torch; keep input errors fast
    from s4r.runtime.session import IngestStats, Session
    from s4r_cli.ui import UI


def open_model(args: CommonArgs, ui: UI) -> Any:
    """Check the device, set the threads, then load the model with a progress display.

    Returns the LoadedModel. A device that is not there (`--device cuda` without a GPU) is bad input:
    UsageError, exit 2. With --rope-scaling, one warning line on stderr says how far the context reaches.
    """
    from s4r.distributed.world import current
    from s4r.errors import DeviceError
    from s4r.models.loading import load_model, resolve_device
    from s4r.runtime.threads import apply_threads

    try:
        device = resolve_device(args.device)  # fail fast, before any download/IO
    except DeviceError as e:
        raise UsageError(error_message(e)) from None
    apply_threads(args.threads, getattr(device, "type", str(device)))
    # under torchrun the ranks split the model's heads
    split = {"tensor_parallel": current().size} if current().distributed else {}
    with ui.loading(args.model) as progress:
        loaded = load_model(args.model, device=args.device, dtype=args.dtype.value, quant=args.quant.value,
                             progress=progress, rope_scaling=args.rope_scaling, **split)
    if args.rope_scaling is not None:
        sys.stderr.write(f"s4r: warning: RoPE scaling x{args.rope_scaling:g} extends the context to "
                         f"{loaded.context_length:,} tokens; answer quality may drop\n")
        sys.stderr.flush()
    return loaded


def ingest(session: Session, doc: Document, ui: UI, *, remedy: str = "--truncate") -> IngestStats:
    """Add one document to the session with a progress bar; one line says what --truncate left out.

    A document over the context is bad input (UsageError, exit 2); ``remedy`` names the way out where
    the user is (``--truncate`` on the command line, ``/set truncate`` in the REPL).
    """
    from s4r.errors import ContextTooLongError

    try:
        with ui.ingesting(doc.name) as progress:
            stats = session.ingest(doc.text, name=doc.name, progress=progress)
    except ContextTooLongError as e:
        raise UsageError(f"{doc.name} is too long: {e.tokens:,} tokens with the conversation, over the "
                         f"model's context of {e.limit:,}; {remedy} head|tail|middle keeps the part that "
                         "fits" + (", --rope-scaling FACTOR stretches the context (lower quality)"
                                   if remedy == "--truncate" else "")) from None
    dropped = getattr(stats, "dropped_tokens", 0)
    if dropped:
        kept = {"head": "kept its start", "tail": "kept its end",
                "middle": "cut out its middle, kept both ends"}.get(str(session.truncate), "kept a part")
        ui.notice(f"truncated {doc.name}: {dropped:,} of {dropped + stats.tokens:,} tokens left out to fit "
                  f"the context ({session.truncate}: {kept})")
    return stats


def check_ratio_reachable(args: CommonArgs, loaded: Any) -> None:
    """Refuse a --ratio the method can never reach on this model, before any document is read."""
    if args.load or args.method == "full":
        return
    from s4r.runtime.ratio_limits import max_ratio

    best = max_ratio(loaded, args.method)
    if args.ratio > best:
        context = int(loaded.context_length)
        raise UsageError(f"--ratio {args.ratio:g} is never reachable with {args.method} on {loaded.name}: at "
                         f"most ×{best:.1f}, even with a document filling the {context:,}-token context; "
                         "use a lower --ratio")


def open_session(args: CommonArgs, loaded: Any, docs: Sequence[Document],
                 ui: UI) -> tuple[Session, float, int]:
    """Create the session (fresh or from --load), ingest the documents.

    Returns (session, ingest seconds, document tokens --truncate left out).

    A ratio the method can never reach is refused first; a document too short for the ratio to pay for
    itself is kept uncompressed, said in one line.
    """
    from s4r.runtime.session import Session
    from s4r_cli.ranks import on_every_rank

    check_ratio_reachable(args, loaded)
    if args.load:
        # under torchrun each rank reads its own part; a rank whose part is refused stops them all
        given = args.session_kwargs(only_explicit=True)
        session = on_every_rank(lambda: Session.load(args.load, loaded, **given))
    else:
        session = Session(loaded, **args.session_kwargs())
    seconds, dropped = 0.0, 0
    for doc in docs:
        stats = ingest(session, doc, ui)
        seconds += stats.seconds
        dropped += getattr(stats, "dropped_tokens", 0)
    if docs:
        report_uncompressed(session, ui)
    return session, seconds, dropped


def report_uncompressed(session: Any, ui: UI) -> None:
    """One line when the documents were kept uncompressed (too short for the ratio), and why."""
    reason = getattr(session, "uncompressed_reason", None)
    if reason:
        ui.notice(f"kept the cache uncompressed (method full): {reason}, so compressing would not pay")
