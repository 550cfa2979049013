"""The process group of a `torchrun` launch: its start (with a timeout), rank 0's voice, and the few
collectives s4r itself needs (the documents, questions and sampled tokens rank 0 decides).

A process started without `torchrun` (no ``WORLD_SIZE`` above 1 in the environment) is a world of one
and every function here is a no-op for it. Every wait on another rank is bounded by the process group's
timeout (``S4R_DIST_TIMEOUT`` seconds, default `DEFAULT_TIMEOUT_S`), so a rank that died or hangs ends the
others with an error instead of a hang.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from s4r.errors import RankError

DEFAULT_TIMEOUT_S = 300.0
TIMEOUT_ENV = "S4R_DIST_TIMEOUT"


@dataclass(frozen=True)
class World:
    """This process's place among the ranks: `rank` of `size`, over `backend` ("" for a world of one)."""

    rank: int = 0
    size: int = 1
    backend: str = ""

    @property
    def is_main(self) -> bool:
        """Whether this process talks to the user (rank 0)."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """Whether there is more than one rank."""
        return self.size > 1


def launched_size() -> int:
    """Ranks the launcher asked for (``WORLD_SIZE``; 1 when not launched by torchrun)."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def timeout_s() -> float:
    """Seconds any wait on another rank may take (``S4R_DIST_TIMEOUT``, default `DEFAULT_TIMEOUT_S`)."""
    try:
        value = float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))
    except ValueError:
        shown = os.environ[TIMEOUT_ENV]
        raise RankError(f"{TIMEOUT_ENV} must be a number of seconds, got {shown!r}") from None
    return value if value > 0 else DEFAULT_TIMEOUT_S


def backend_for(device_type: str) -> str:
    """NCCL for CUDA devices, gloo for CPUs."""
    return "nccl" if device_type == "cuda" else "gloo"


def current() -> World:
    """The world this process is in now (a world of one before `start` or without torchrun)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return World()
    dist = torch.distributed
    return World(dist.get_rank(), dist.get_world_size(), str(dist.get_backend()))


def start(device_type: str = "cpu") -> World:
    """Join the launch's process group (once; later calls return it). A world of one when not launched.

    The group starts from torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``) with the timeout of `timeout_s`, which also bounds every later collective. On CUDA each
    rank takes the GPU of its ``LOCAL_RANK``.
    """
    world = current()
    if world.distributed or launched_size() == 1:
        return world
    backend = backend_for(device_type)
    try:
        rank = int(os.environ["RANK"])
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        torch.distributed.init_process_group(backend=backend, rank=rank, world_size=launched_size(),
                                             timeout=timedelta(seconds=timeout_s()))
    except (KeyError, ValueError) as exc:
        raise RankError(f"WORLD_SIZE is {launched_size()} but the launch's RANK/MASTER_ADDR/MASTER_PORT are "
                        f"missing or bad ({exc}); start s4r on several ranks with torchrun") from None
    except Exception as exc:  # noqa: BLE001 - a store timeout, a refused port: one line either way
        raise RankError(f"the {launched_size()} ranks could not meet within {timeout_s():g} s "
                        f"({describe(exc)})") from None
    return current()


def stop() -> None:
    """Leave the process group (at the end of a command)."""
    if current().distributed:
        torch.distributed.destroy_process_group()


def describe(exc: BaseException) -> str:
    """The first line of a collective's failure, for a one-line error."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:200]


def lost(exc: BaseException) -> RankError:
    """The error to report when a collective failed: another rank stopped or did not answer."""
    return RankError(f"another rank stopped or did not answer within {timeout_s():g} s ({describe(exc)})")


def broadcast(obj: Any = None) -> Any:
    """Rank 0's `obj` on every rank (a picklable value); `obj` is ignored on the other ranks."""
    world = current()
    if not world.distributed:
        return obj
    box = [obj if world.is_main else None]
    try:
        torch.distributed.broadcast_object_list(box, src=0)
    except Exception as exc:  # noqa: BLE001
        raise lost(exc) from None
    return box[0]


def gather(value: Any) -> list[Any]:
    """Every rank's `value`, in rank order, on every rank."""
    world = current()
    if not world.distributed:
        return [value]
    out: list[Any] = [None] * world.size
    try:
        torch.distributed.all_gather_object(out, value)
    except Exception as exc:  # noqa: BLE001
        raise lost(exc) from None
    return out


def agree_token(token: int) -> int:
    """Rank 0's sampled token on every rank, so all ranks continue the same answer (one small broadcast)."""
    world = current()
    if not world.distributed:
        return token
    device = "cuda" if world.backend == "nccl" else "cpu"
    box = torch.tensor([token], dtype=torch.long, device=device)
    try:
        torch.distributed.broadcast(box, src=0)
    except Exception as exc:  # noqa: BLE001
        raise lost(exc) from None
    return int(box.item())
