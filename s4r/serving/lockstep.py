"""Serving under torchrun: rank 0 takes the requests, and every other rank makes the same engine calls.

The collectives inside a tensor-parallel model need every rank, so rank 0's `Engine` broadcasts each
call it is about to make (`preload`, `complete`: the call and its arguments, one `broadcast_object_list`)
and the followers, in `follow`, make the same call with their share of the heads. Between requests rank
0 broadcasts a keep-alive now and then (`keepalive`), so a follower's wait for the next call stays within
the process group's timeout and a dead follower is noticed while idle; `release` ends the followers.
What a call decides on rank 0 alone (a client leaving, the sampled token) reaches the followers inside
the call (`s4r.serving.generate`); what the store keeps is agreed by the ranks (`document_store`).
Without torchrun every function here is a no-op.
"""

from __future__ import annotations

from typing import Any

from s4r.distributed.world import broadcast, current, lost
from s4r.errors import RankError

PRELOAD, COMPLETE, IDLE, STOP = "preload", "complete", "idle", "stop"


def leading() -> bool:
    """Whether this process is rank 0 of several (the one that takes the requests)."""
    me = current()
    return me.distributed and me.is_main


def lead(kind: str, *args: Any) -> None:
    """On rank 0 of several: tell the followers the call it makes now (a no-op elsewhere)."""
    if leading():
        broadcast((kind, args))


def follow(engine: Any) -> bool:
    """On a follower rank: make rank 0's engine calls until rank 0 releases the ranks. Returns whether
    rank 0 ended well; raises RankError when rank 0 is gone or the ranks fell out of step."""
    while True:
        kind, args = broadcast()
        if kind == STOP:
            return bool(args[0])
        if kind == IDLE:
            continue
        try:
            if kind == PRELOAD:
                engine.preload(*args)
            elif kind == COMPLETE:
                prompt, sampling, name = args
                engine.complete(prompt, sampling, name=name)
            else:
                raise RankError(f"rank 0 asked for an unknown call '{kind}'")
        except RankError:
            raise
        except RuntimeError as exc:  # a collective inside the model failed
            raise lost(exc) from None
        except Exception:  # noqa: BLE001, S112 - rank 0 met the same error (bad input) and answered with it
            continue


def keepalive() -> None:
    """On rank 0 of several: one keep-alive to the waiting followers."""
    lead(IDLE)


def release(ok: bool) -> None:
    """On rank 0 of several: end the followers (`ok`: whether rank 0 itself ends well)."""
    lead(STOP, ok)
