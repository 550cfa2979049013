"""Subprocess of tests/test_memory_cap.py: a layer-wise ingest under an address-space cap, hidden states
kept in memory or spilled to a temp file between layers.

    python -m tests.memory_cap_spill_probe FRACTION

builds a random wide Llama whose hidden states of the document are as large as its full KV cache (hidden
size 1024 against one KV head of 64: wide models with few KV heads), caps the process's address space
(RLIMIT_AS) at its size now plus FRACTION of the document's hidden states, then ingests the document with
s4r at ratio 5 layer-wise, hidden states in memory, then spilled. Prints one line per attempt:
"<spill> ok <stored bytes> <hidden bytes>" or "<spill> out-of-memory".
"""

from __future__ import annotations

import gc
import resource
import sys
from types import SimpleNamespace

import torch

from s4r.memory import release_freed_memory
from s4r.session import Session
from tests.helpers import CharTokenizer, tiny_model
from tests.memory_cap_probe import vm_size_bytes

DOC_CHARS = 3000


def main(fraction: float) -> None:
    model = tiny_model("llama", hidden_size=2048, num_attention_heads=4, num_key_value_heads=1, head_dim=64,
                       intermediate_size=128, num_hidden_layers=8, max_position_embeddings=4096)
    loaded = SimpleNamespace(model=model, tokenizer=CharTokenizer(), name="wide", device="cpu",
                             dtype=torch.float32, context_length=4096)
    text = "".join(chr(97 + (i * 7919) % 26) for i in range(DOC_CHARS))
    # every code path once before the cap (library workspaces, lazily loaded kernels, the spill file)
    warm = Session(loaded, method="s4r", ratio=2, chunk_size=256, hidden_spill="on")
    warm.ingest(text[:600])
    warm.ask("hi", max_new_tokens=1)
    del warm
    hidden = DOC_CHARS * model.config.hidden_size * 4
    gc.collect()
    release_freed_memory()
    resource.setrlimit(resource.RLIMIT_AS, (vm_size_bytes() + int(fraction * hidden), resource.RLIM_INFINITY))
    for spill in ("off", "on"):
        session = Session(loaded, method="s4r", ratio=5, chunk_size=256, hidden_spill=spill)
        try:
            session.ingest(text)
            print(f"{spill} ok {session.memory().stored_bytes} {hidden}", flush=True)
        except (MemoryError, RuntimeError) as exc:
            if "alloc" not in str(exc) and not isinstance(exc, MemoryError):
                raise
            print(f"{spill} out-of-memory", flush=True)
        del session
        gc.collect()
        release_freed_memory()


if __name__ == "__main__":
    main(float(sys.argv[1]))
