"""Saved caches under tensor parallelism: one file per rank.

A cache saved by one process is the file named. Saved by N > 1 ranks, rank r writes its own heads' cache to
``NAME.rank<r>-of-<N>`` beside it (each a complete cache file with its own checksum), in parallel and with
no gathering; loading ``NAME`` under N ranks has each rank read its own part. A run with another number
of ranks than the files were saved with is refused in one line that says how many it needs.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from s4r.errors import CacheFileError

if TYPE_CHECKING:  # the CLI checks a path with `exists` before torch is imported
    from s4r.distributed.world import World


def _current() -> World:
    from s4r.distributed.world import current

    return current()

_PART = re.compile(r"\.rank(\d+)-of-(\d+)$")


def part_path(path: str | Path, rank: int, size: int) -> Path:
    """The file rank `rank` of `size` keeps its part of the cache `path` in (`path` itself for one rank)."""
    path = Path(path)
    return path if size == 1 else path.with_name(f"{path.name}.rank{rank}-of-{size}")


def rank_path(path: str | Path, world: World | None = None) -> Path:
    """This rank's file for the cache `path`."""
    world = world or _current()
    return part_path(path, world.rank, world.size)


def saved_sizes(path: str | Path) -> list[int]:
    """The rank counts whose part files of `path` exist (one entry per complete or partial set)."""
    path = Path(path)
    sizes = set()
    for part in path.parent.glob(f"{path.name}.rank*-of-*"):
        match = _PART.search(part.name)
        if match and part.name[: match.start()] == path.name:
            sizes.add(int(match.group(2)))
    return sorted(sizes)


def _runs(n: int) -> str:
    return "one process (no torchrun)" if n == 1 else f"{n} ranks (torchrun --nproc-per-node {n})"


def exists(path: str | Path) -> bool:
    """Whether `path` names a saved cache: the file, or the parts saved by several ranks."""
    path = Path(path)
    return path.is_file() or bool(saved_sizes(path))


def load_path(path: str | Path, world: World | None = None) -> Path:
    """This rank's file of the saved cache `path`; a CacheFileError in one line when it was saved by
    another number of ranks than this run has."""
    world = world or _current()
    path = Path(path)
    mine = rank_path(path, world)
    if mine.is_file():
        return mine
    saved = ([1] if path.is_file() else []) + saved_sizes(path)
    if not saved:
        raise CacheFileError(f"saved cache not found: {path}")
    if world.size not in saved:
        need = f"{saved[0]} rank{'s' if saved[0] > 1 else ''}"
        raise CacheFileError(f"saved cache {path} was saved by {_runs(saved[0])}; this run has "
                             f"{_runs(world.size)}: load it with {need}")
    raise CacheFileError(f"saved cache {path} lacks the part of rank {world.rank} of {world.size} "
                         f"({mine.name})")


def check_saved_ranks(meta: dict, path: str | Path, world: World | None = None) -> None:
    """Refuse a part file whose header says it belongs to another rank or rank count (a renamed file)."""
    world = world or _current()
    saved = meta.get("ranks") or {"rank": 0, "of": 1}
    if (int(saved.get("rank", 0)), int(saved.get("of", 1))) != (world.rank, world.size):
        raise CacheFileError(f"saved cache {path} is the part of rank {saved.get('rank')} of "
                             f"{saved.get('of')}, not of rank {world.rank} of {world.size}")


def ranks_meta(world: World | None = None) -> dict[str, int]:
    """What a saved part records about the ranks that wrote it."""
    world = world or _current()
    return {"rank": world.rank, "of": world.size}
