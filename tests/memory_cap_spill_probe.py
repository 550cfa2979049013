"""Subprocess of tests/test_layerwise_spill_cap.py: a layer-wise ingest under an address-space cap,
hidden states kept in memory or spilled to a temp file between layers.

    python -m tests.memory_cap_spill_probe FRACTION

builds a random wide Llama whose hidden states of the document are as large as its full KV cache (hidden
size 2048 against one KV head of 64: wide models with few KV heads), caps the process's address space
(RLIMIT_AS) at its size now plus FRACTION of the document's hidden states, then ingests the document with
s4r at ratio 5 layer-wise, hidden states in memory, then spilled. Prints one line per attempt:
"<spill> ok <stored bytes> <hidden bytes>" or "<spill> out-of-memory".
"""

from __future__ import annotations

import sys

from tests.memory_cap_probe import ingest_under_cap, probe_setup

DOC_CHARS = 3000


def main(fraction: float) -> None:
    loaded, text = probe_setup("wide", DOC_CHARS, hidden_size=2048, num_attention_heads=4,
                               num_key_value_heads=1, head_dim=64, num_hidden_layers=8)
    model = loaded.model
    hidden = DOC_CHARS * model.config.hidden_size * 4
    ingest_under_cap(loaded, text, int(fraction * hidden),
                     {"off": {"hidden_spill": "off"}, "on": {"hidden_spill": "on"}},
                     lambda session: hidden, {"hidden_spill": "on"})


if __name__ == "__main__":
    main(float(sys.argv[1]))
