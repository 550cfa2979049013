"""The process's measured memory: a resettable peak, freed pages given back, no residual-sized transient."""

from __future__ import annotations

import sys

import pytest
import torch

from s4r.core.subspace import relative_residual
from s4r.runtime.memory import (
    bound_heap_growth,
    peak_memory_bytes,
    process_memory,
    release_freed_memory,
    reset_peak_memory,
    rss_bytes,
)

MIB = 2**20
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and glibc are Linux's")


@linux_only
def test_peak_rises_with_a_big_buffer_and_resets():
    if not reset_peak_memory():
        pytest.skip("this kernel does not let a process reset its peak RSS")
    before = peak_memory_bytes()
    buffer = torch.ones(64 * MIB // 4)  # written, so its pages are resident
    raised = peak_memory_bytes()
    assert raised - before >= 60 * MIB
    del buffer
    release_freed_memory()
    assert reset_peak_memory()
    assert peak_memory_bytes() < raised - 32 * MIB


@linux_only
def test_freed_heap_goes_back_to_the_os():
    bound_heap_growth()
    release_freed_memory()
    start = rss_bytes()
    # heap-sized buffers with small live allocations between them: freeing the buffers leaves holes
    # that only malloc_trim hands back (the heap's top never comes down on its own). 127 MiB of them: in
    # a full suite earlier tests leave heap pages that some buffers reuse without growing the RSS
    buffers, pins = [], []
    for _ in range(1300):
        buffers.append(torch.ones(25_000))
        pins.append(torch.ones(8))
    held = rss_bytes()
    del buffers
    assert release_freed_memory()
    assert held - start > 80 * MIB
    assert rss_bytes() - start < 32 * MIB


def test_process_memory_names_what_it_counts():
    proc = process_memory(torch.device("cpu"))
    assert proc.kind == "RSS"
    assert proc.peak_bytes > 0


def test_relative_residual_is_the_uncaptured_share():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 50, 16, generator=gen)
    basis = torch.linalg.qr(torch.randn(2, 16, 5, generator=gen)).Q
    explicit = x - x @ basis @ basis.transpose(1, 2)
    want = explicit.pow(2).sum(dim=(0, 2)) / x.pow(2).sum(dim=(0, 2))
    torch.testing.assert_close(relative_residual(x, basis), want, rtol=1e-4, atol=1e-5)
