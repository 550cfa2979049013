"""Proof that layer-wise ingest matters: under a memory cap the full staging cache cannot be built, the
layer-wise compressed ingest of the same document can."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc are Linux's")
def test_layerwise_ingest_fits_where_the_full_cache_does_not():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    # half the document's full KV cache on top of what the process holds after warming up
    out = subprocess.run([sys.executable, "-m", "tests.memory_cap_probe", "0.5"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.strip().splitlines())
    assert lines["chunked"] == "out-of-memory"
    status, stored, full = lines["layerwise"].split()
    assert status == "ok"
    assert int(stored) * 4 < int(full)
