"""The CLI under torchrun: rank 0 talks to the user, the other ranks follow it.

Rank 0 reads the documents, the question or each chat line and broadcasts them; every rank then runs the
same session calls (its share of the model's heads), and only rank 0 writes anything (the other ranks'
stdout and stderr go to /dev/null unless ``S4R_ALL_RANKS_LOG=1``). Without torchrun all of this is a
no-op: a world of one.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from s4r.errors import RankError
from s4r_cli.cli_errors import UsageError

T = TypeVar("T")
LOG_ALL_ENV = "S4R_ALL_RANKS_LOG"
# a follower's exit when rank 0 refused the input (rank 0 says why, with its own exit code)
EXIT_FOLLOWER = 1


def launched() -> bool:
    """Whether torchrun started this process as one of several ranks."""
    from s4r.distributed.world import launched_size

    return launched_size() > 1


def is_main_rank() -> bool:
    """Whether this process talks to the user (rank 0, or the only process)."""
    from s4r.distributed.world import current

    return current().is_main


def start_ranks(device: str) -> Any:
    """Join the process group when launched by torchrun (gloo on CPUs, NCCL on GPUs) and mute the followers.
    Returns the `World` (a world of one without torchrun)."""
    from s4r.distributed import world

    if not launched():
        return world.current()
    try:
        from s4r.models.device import resolve_device

        kind = resolve_device(device).type
    except Exception:  # noqa: BLE001 - open_model reports a bad device in its own words
        kind = "cpu"
    me = world.start(kind)
    if not me.is_main and os.environ.get(LOG_ALL_ENV) != "1":
        _mute()
    _end_on_sigterm()
    return me


def mute_followers() -> None:
    """Before anything is parsed or loaded: a follower rank of a torchrun launch writes nothing (rank 0
    reports bad options and errors once). Reads only the environment, so torch is not imported."""
    if os.environ.get("WORLD_SIZE", "1") not in ("", "0", "1") and os.environ.get("RANK", "0") != "0" \
            and os.environ.get(LOG_ALL_ENV) != "1":
        _mute()


def _mute() -> None:
    """Send this process's stdout and stderr (Python's and the C libraries') to /dev/null."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
            os.dup2(devnull, stream.fileno())
        except (OSError, ValueError, AttributeError):
            pass


def _end_on_sigterm() -> None:
    """torchrun stops the other ranks with SIGTERM when one fails: end with one line, not a traceback."""
    def handler(signum: int, frame: Any) -> None:
        raise RankError("the launcher stopped this rank because another rank ended (see its message)")

    signal.signal(signal.SIGTERM, handler)


def on_main(step: Callable[[], T]) -> T:
    """Run `step` on rank 0 only and hand its result to every rank. When it fails on rank 0 (bad input),
    rank 0 raises as without torchrun and the followers exit quietly with EXIT_FOLLOWER."""
    from s4r.distributed import world

    me = world.current()
    if not me.distributed:
        return step()
    if me.is_main:
        try:
            value = step()
        except BaseException:
            world.broadcast(("failed", None))
            raise
        world.broadcast(("ok", value))
        return value
    status, value = world.broadcast()
    if status != "ok":
        raise SystemExit(EXIT_FOLLOWER)
    return value


def on_every_rank(step: Callable[[], T]) -> T:
    """Run `step` (no collectives inside) on every rank, then agree: when it failed on any rank, every rank
    stops; rank 0 raises its own error, or says which rank failed and why."""
    from s4r.distributed import world

    me = world.current()
    if not me.distributed:
        return step()
    error: BaseException | None = None
    value: Any = None
    try:
        value = step()
    except Exception as exc:  # noqa: BLE001 - reported below, on rank 0
        error = exc
    messages = world.gather(None if error is None else _one_line(error))
    failed = [(rank, text) for rank, text in enumerate(messages) if text is not None]
    if not failed:
        return value
    if not me.is_main:
        raise SystemExit(EXIT_FOLLOWER)
    if error is not None:
        raise error
    rank, text = failed[0]
    raise RankError(f"rank {rank}: {text}")


def _one_line(exc: BaseException) -> str:
    from s4r_cli.cli_errors import error_message

    return error_message(exc) if not isinstance(exc, UsageError) else str(exc)


class RankReader:
    """A chat input reader shared by the ranks: rank 0 reads each line (or end of input, or Ctrl-C) and
    every other rank gets the same, so all run the same command."""

    def __init__(self, reader: Any | None):
        self.reader = reader

    def read(self) -> str:
        """One input, as rank 0 read it; EOFError / KeyboardInterrupt on every rank where it got them."""
        from s4r.distributed import world

        if world.current().is_main:
            try:
                line = self.reader.read()
            except EOFError:
                world.broadcast(("eof", None))
                raise
            except KeyboardInterrupt:
                world.broadcast(("interrupt", None))
                raise
            world.broadcast(("line", line))
            return line
        kind, line = world.broadcast()
        if kind == "eof":
            raise EOFError
        if kind == "interrupt":
            raise KeyboardInterrupt
        return str(line)


def memory_fields(memory: Any) -> dict[str, Any]:
    """The --json fields of the cache over all ranks: bytes per rank and in all, the ratio of the sums.
    Called on every rank (it gathers); empty without torchrun."""
    from s4r.distributed import world

    me = world.current()
    if not me.distributed:
        return {}
    stored = world.gather(int(memory.stored_bytes))
    full = world.gather(int(memory.full_bytes))
    return {"ranks": me.size, "kv_bytes_per_rank": stored, "kv_full_bytes_per_rank": full,
            "kv_bytes": sum(stored), "kv_full_bytes": sum(full),
            "ratio_achieved": sum(full) / sum(stored) if sum(stored) else float("inf")}


@contextmanager
def collectives_checked() -> Iterator[None]:
    """Under torchrun, a collective that failed inside the model (a rank died: gloo's "connection closed",
    NCCL's errors, a timeout) becomes one line saying another rank stopped."""
    from s4r.distributed import world

    try:
        yield
    except RuntimeError as exc:
        if not world.current().distributed or isinstance(exc, RankError):
            raise
        raise world.lost(exc) from None


def finish() -> None:
    """Leave the process group at the end of a command."""
    from s4r.distributed import world

    world.stop()
