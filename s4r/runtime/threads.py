"""How many CPU threads torch gets: every command (chat, ask, bench) follows the same policy.

torch's default (one thread per core) collapses when other jobs hold cores: its threads wait on one
another at every operation. Measured on 2 cores beside one busy process: a 2.5k-token `ask` took 4 min
48 s with 2 threads and 12 s with 1; a `bench --quick` run 23 min against 2 min. So, unless told
otherwise, torch gets the cores other processes leave free, and at least one. Busy cores are the larger
of the 1-minute load average and the CPU use measured over a fifth of a second at start: the load
average alone lags a job started a minute ago by half its weight.
"""

from __future__ import annotations

import contextlib
import os

__all__ = ["auto_threads", "busy_cores", "choose_threads", "apply_threads", "usable_cores"]

SAMPLE_SECONDS = 0.2


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, e.g. under taskset or a container's cpuset)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity on this platform (macOS, Windows)
        return os.cpu_count() or 1


def busy_cores(sample_seconds: float = SAMPLE_SECONDS) -> float | None:
    """Cores other processes keep busy now: max(1-minute load average, CPU use sampled over
    ``sample_seconds``). None when neither can be read (no load average, no psutil)."""
    readings = []
    with contextlib.suppress(OSError, AttributeError):  # no load average on this platform (Windows)
        readings.append(os.getloadavg()[0])
    try:
        import psutil

        cores = os.cpu_count() or 1
        readings.append(psutil.cpu_percent(interval=sample_seconds) / 100 * cores)
    except Exception:  # noqa: BLE001 - psutil missing or unreadable /proc: the load average will do
        pass
    return max(readings) if readings else None


def auto_threads(cores: int | None = None, load: float | None = None) -> int | None:
    """Threads for a CPU run when none were asked for: the cores other processes leave free (at least 1).

    ``cores`` defaults to :func:`usable_cores` and ``load`` to :func:`busy_cores`. None (keep torch's
    choice) when ``OMP_NUM_THREADS`` says what to use or the machine's load cannot be read.
    """
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    cores = cores or usable_cores()
    if load is None:
        load = busy_cores()
        if load is None:
            return None
    return max(1, min(cores, cores - round(load)))


def choose_threads(requested: int | None, device_type: str = "cpu") -> int | None:
    """The thread count to set: ``requested`` when given (--threads), else :func:`auto_threads` on CPU.

    None means leave torch as it is (a GPU run, or OMP_NUM_THREADS set).
    """
    if requested is not None:
        if requested < 1:
            raise ValueError(f"--threads must be at least 1, got {requested}")
        return requested
    return auto_threads() if device_type == "cpu" else None


def apply_threads(requested: int | None, device_type: str = "cpu") -> int:
    """Set torch's intra-op threads by :func:`choose_threads`; return the count torch now uses."""
    import torch  # lazy: callers decide threads before the slow imports where they can

    n = choose_threads(requested, device_type)
    if n is not None:
        torch.set_num_threads(n)
    return torch.get_num_threads()
