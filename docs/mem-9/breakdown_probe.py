"""Where the memory of a layer-wise s4r ingest goes: VmHWM/VmRSS checkpoints around each step of the
first LAYERS layers (the per-layer pattern repeats; later layers only add compressed cache).

    PYTHONPATH=<tree> OMP_NUM_THREADS=1 python docs/mem-9/breakdown_probe.py TOKENS ROPE|none LAYERS
"""
import contextlib
import sys

import s4r.core.compress as C
import s4r.hf.cache as CA
import s4r.runtime.session as S
from s4r.bench.ingest_memory import passage
from s4r.models.loading import load_model
from s4r.runtime.memory import _status_kib, release_freed_memory, reset_peak_memory
from s4r.runtime.session import Session

TOKENS, LAYERS = int(sys.argv[1]), int(sys.argv[3])
ROPE = float(sys.argv[2]) if sys.argv[2] != "none" else None
MiB = 1024 * 1024
rows, base = [], [0]

def mark(label):
    hwm, rss = _status_kib("VmHWM") * 1024, _status_kib("VmRSS") * 1024
    rows.append((label, (hwm - base[0]) / MiB, (rss - base[0]) / MiB))
    reset_peak_memory()

def wrap(mod, name):
    f = getattr(mod, name)
    def g(*a, **k):
        mark(f"  before {name}")
        out = f(*a, **k)
        mark(f"  in {name}")
        return out
    setattr(mod, name, g)

for n in ("compressible_parts", "fit_layer_bases", "encode_coefficients", "outlier_tokens", "project",
          "LowRankLayer", "attention_effect"):
    wrap(C, n)

class Stop(Exception):
    pass

done = [0]
def after_layer(device=None):
    mark(f"L{done[0]} before trim (compress done)")
    release_freed_memory(device)
    mark(f"L{done[0]} after trim")
    done[0] += 1
    if done[0] >= LAYERS:
        raise Stop

loaded = load_model("smollm2-135m", device="cpu", dtype="auto", rope_scaling=ROPE)
text = passage(loaded.tokenizer, TOKENS, None)
warm = Session(loaded, method="s4r", ratio=2.0, chunk_size=512)
warm.ingest(text[: len(text) * 600 // max(TOKENS, 600)])
warm.ask("Hi", max_new_tokens=1)
del warm
S.release_freed_memory = after_layer
session = Session(loaded, method="s4r", ratio=5.0, ingest="layerwise", chunk_size=512)
release_freed_memory()
base[0] = _status_kib("VmRSS") * 1024
rows.clear()
orig_reserve, orig_release = session.__class__, None
r0, r1 = CA.CompressedCache.reserve_layer, CA.CompressedCache.release_layer
def reserve(self, i, *a):
    mark(f"L{i-1} before reserve {i}" if i else "start")
    r0(self, i, *a)
    mark(f"L{i} reserved; prefill starts")
def release(self, i):
    mark(f"L{i} prefill done; kv+cache={self.nbytes()/MiB:.1f} MiB")
    r1(self, i)
    mark(f"L{i} compressed; cache nbytes={self.nbytes()/MiB:.1f} MiB")
CA.CompressedCache.reserve_layer, CA.CompressedCache.release_layer = reserve, release
orig_compress = session._compress
def comp(**k):
    mark(f"L0 prefill done; kv+cache={session.cache.nbytes()/MiB:.1f} MiB")
    orig_compress(**k)
    mark(f"L0 compressed; cache nbytes={session.cache.nbytes()/MiB:.1f} MiB")
session._compress = comp
reset_peak_memory()
with contextlib.suppress(Stop):
    session.ingest(text)
print(f"tokens {TOKENS} rope {ROPE}; MiB above RSS before ingest: peak in segment ending at label, "
      "RSS at label")
for label, peak, rss in rows:
    print(f"{peak:8.1f} {rss:8.1f}  {label}")
