"""Real model: spill on vs off, s4r and full, document + append; compare every tensor of the cache."""
import sys

import torch

from s4r.books import load_book
from s4r.models.loading import load_model
from s4r.runtime.session import Session

torch.set_num_threads(1)
loaded = load_model('smollm2-135m')
tok = loaded.tokenizer
ids = tok.encode(load_book(), add_special_tokens=False)
doc, extra = tok.decode(ids[5000:5000 + int(sys.argv[1])]), tok.decode(ids[20000:20600])
def tensors(obj, seen=None):
    out = []
    for layer in obj.cache.layers:
        for k, v in sorted(layer.state().items()):
            if isinstance(v, torch.Tensor):
                out.append((k, v))
    return out
for method in sys.argv[2].split(","):
    res = {}
    for n, spill in enumerate(sys.argv[3].split(",")):
        s = Session(loaded, method=method, ratio=5.0, hidden_spill=spill)
        st = [s.ingest(doc), s.ingest(extra)]
        ans, _ = s.ask("Who is speaking?", max_new_tokens=12)
        res[n] = (ans, [x.hidden_spilled for x in st], tensors(s), s.memory())
    a, b = list(res.values())[0], list(res.values())[-1] if len(res) > 1 else None
    n_eq = sum(torch.equal(x[1], y[1]) for x, y in zip(a[2], b[2], strict=True))
    print("unequal:", sorted({x[0] for x, y in zip(a[2], b[2], strict=True) if not torch.equal(x[1], y[1])}))
    print(method, "spilled", a[1], b[1], "answers equal", a[0] == b[0], repr(a[0]), "tensors equal", n_eq,
          "/",
          len(a[2]), len(b[2]), "memory equal", a[3] == b[3])
