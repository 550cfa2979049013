"""Subprocess of tests/test_memory_cap.py: ingest one document under an address-space cap.

    python -m tests.memory_cap_probe FRACTION

builds a random deep, narrow Llama whose full KV cache of the document is large next to its weights,
caps the process's address space (RLIMIT_AS) at its size now plus FRACTION of that full cache, then
ingests the document with s4r at ratio 5, first token-chunked (a full staging cache), then layer-wise.
Prints one line per attempt: "<mode> ok <stored bytes> <full bytes>" or "<mode> out-of-memory".
"""

from __future__ import annotations

import gc
import resource
import sys
from types import SimpleNamespace

import torch

from s4r.budget import KVShape
from s4r.memory import release_freed_memory
from s4r.session import Session
from tests.helpers import CharTokenizer, tiny_model

DOC_CHARS = 1500


def vm_size_bytes() -> int:
    """The process's address-space size now (Linux)."""
    with open("/proc/self/status", encoding="ascii") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))


def main(fraction: float) -> None:
    model = tiny_model("llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=4, head_dim=64,
                       intermediate_size=128, num_hidden_layers=48, max_position_embeddings=4096)
    loaded = SimpleNamespace(model=model, tokenizer=CharTokenizer(), name="deep-narrow", device="cpu",
                             dtype=torch.float32, context_length=4096)
    text = "".join(chr(97 + (i * 7919) % 26) for i in range(DOC_CHARS))
    # every code path once before the cap (library workspaces, lazily loaded kernels)
    warm = Session(loaded, method="s4r", ratio=2, chunk_size=256)
    warm.ingest(text[:600])
    warm.ask("hi", max_new_tokens=1)
    del warm
    full = KVShape.from_config(model.config, 4).full_bytes(DOC_CHARS)
    gc.collect()
    release_freed_memory()
    resource.setrlimit(resource.RLIMIT_AS, (vm_size_bytes() + int(fraction * full), resource.RLIM_INFINITY))
    for mode in ("chunked", "layerwise"):
        session = Session(loaded, method="s4r", ratio=5, ingest=mode, chunk_size=256)
        try:
            session.ingest(text)
            mem = session.memory()
            print(f"{mode} ok {mem.stored_bytes} {mem.full_bytes}", flush=True)
        except (MemoryError, RuntimeError) as exc:
            if "alloc" not in str(exc) and not isinstance(exc, MemoryError):
                raise
            print(f"{mode} out-of-memory", flush=True)
        del session
        gc.collect()
        release_freed_memory()


if __name__ == "__main__":
    main(float(sys.argv[1]))
