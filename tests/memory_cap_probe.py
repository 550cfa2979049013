"""Subprocess of tests/test_memory_cap.py: ingest one document under an address-space cap (and the
shared runner of the memory-cap probes).

    python -m tests.memory_cap_probe FRACTION

builds a random deep, narrow Llama whose full KV cache of the document is large next to its weights,
caps the process's address space (RLIMIT_AS) at its size now plus FRACTION of that full cache, then
ingests the document with s4r at ratio 5, first token-chunked (a full staging cache), then layer-wise.
Prints one line per attempt: "<mode> ok <stored bytes> <full bytes>" or "<mode> out-of-memory".
"""

from __future__ import annotations

import gc
import os
import resource
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from s4r.core.budget import KVShape
from s4r.runtime.memory import release_freed_memory
from s4r.runtime.session import Session
from tests.helpers import CharTokenizer, tiny_model

DOC_CHARS = 1500


def vm_size_bytes() -> int:
    """The process's address-space size now (Linux)."""
    with open("/proc/self/status", encoding="ascii") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))


def run_probe(module: str, fraction: float) -> dict[str, str]:
    """Run probe `module` (`tests.<name>`) with FRACTION in a subprocess: {attempt: rest of its line}."""
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-m", module, str(fraction)], cwd=root, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return dict(line.split(" ", 1) for line in out.stdout.strip().splitlines())


def ingest_under_cap(loaded, text: str, extra_bytes: int, attempts: dict[str, dict[str, Any]],
                     reference: Callable[[Session], int], warm_kwargs: dict[str, Any]) -> None:
    """Warm every code path up, cap the address space at its size now plus `extra_bytes`, then ingest
    `text` at ratio 5 once per attempt (its Session options); print "<attempt> ok <stored bytes>
    <reference bytes>" or "<attempt> out-of-memory" for each."""
    # every code path once before the cap (library workspaces, lazily loaded kernels, a spill file)
    warm = Session(loaded, method="s4r", ratio=2, chunk_size=256, **warm_kwargs)
    warm.ingest(text[:600])
    warm.ask("hi", max_new_tokens=1)
    del warm
    gc.collect()
    release_freed_memory()
    resource.setrlimit(resource.RLIMIT_AS, (vm_size_bytes() + extra_bytes, resource.RLIM_INFINITY))
    for label, kwargs in attempts.items():
        session = Session(loaded, method="s4r", ratio=5, chunk_size=256, **kwargs)
        try:
            session.ingest(text)
            print(f"{label} ok {session.memory().stored_bytes} {reference(session)}", flush=True)
        except (MemoryError, RuntimeError) as exc:
            if "alloc" not in str(exc) and not isinstance(exc, MemoryError):
                raise
            print(f"{label} out-of-memory", flush=True)
        del session
        gc.collect()
        release_freed_memory()


def probe_setup(name: str, chars: int, **shape: int) -> tuple[SimpleNamespace, str]:
    """A random fp32 Llama of `shape` loaded as the library expects, and a `chars`-long document."""
    model = tiny_model("llama", intermediate_size=128, max_position_embeddings=4096, **shape)
    loaded = SimpleNamespace(model=model, tokenizer=CharTokenizer(), name=name, device="cpu",
                             dtype=torch.float32, context_length=4096)
    return loaded, "".join(chr(97 + (i * 7919) % 26) for i in range(chars))


def main(fraction: float) -> None:
    loaded, text = probe_setup("deep-narrow", DOC_CHARS, hidden_size=256, num_attention_heads=4,
                               num_key_value_heads=4, head_dim=64, num_hidden_layers=48)
    model = loaded.model
    full = KVShape.from_config(model.config, 4).full_bytes(DOC_CHARS)
    ingest_under_cap(loaded, text, int(fraction * full),
                     {"chunked": {"ingest": "chunked"}, "layerwise": {"ingest": "layerwise"}},
                     lambda session: session.memory().full_bytes, {})


if __name__ == "__main__":
    main(float(sys.argv[1]))
