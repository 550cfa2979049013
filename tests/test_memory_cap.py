"""Proof that layer-wise ingest matters: under a memory cap the full staging cache cannot be built, the
layer-wise compressed ingest of the same document can."""

from __future__ import annotations

import sys

import pytest

from tests.memory_cap_probe import run_probe


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc are Linux's")
def test_layerwise_ingest_fits_where_the_full_cache_does_not():
    # half the document's full KV cache on top of what the process holds after warming up
    lines = run_probe("tests.memory_cap_probe", 0.5)
    assert lines["chunked"] == "out-of-memory"
    status, stored, full = lines["layerwise"].split()
    assert status == "ok"
    assert int(stored) * 4 < int(full)
