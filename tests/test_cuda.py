"""The same code path on CUDA: exactness at full rank, the default method's decode, and 4-bit weights.

Skipped without a GPU (CI has none); run on a lent GPU with `pytest tests/test_cuda.py`.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from s4r.config import S4RConfig
from s4r.core.budget import KVShape
from s4r.core.rope import model_rope_fn
from s4r.hf.attention import install
from s4r.hf.cache import CompressedCache
from s4r.hf.generation import forward_tokens, prefill
from s4r.methods import CompressContext, S4RMethod
from tests.helpers import tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def no_tf32():
    # TF32 matmuls round to 10 mantissa bits: the full-rank comparison needs true fp32 products
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def compressed(model, doc: torch.Tensor, cfg: S4RConfig) -> CompressedCache:
    install(model)
    shape = KVShape.from_config(model.config, next(model.parameters()).element_size())
    cache = CompressedCache(shape.layers, shape, query_window=cfg.query_window)
    with torch.inference_mode():
        prefill(model, cache, doc, 0, chunk_size=96)
        S4RMethod(cfg).compress(cache, CompressContext(model_rope_fn(model), cfg.ratio or 1.0))
    return cache


@pytest.mark.parametrize(("key_space", "granularity"), [("post_rope", "layer"), ("pre_rope", "head")])
def test_full_rank_matches_the_full_cache_on_cuda(key_space, granularity):
    model = tiny_model("llama").to(CUDA)
    width = 16 if granularity == "head" else 32
    cfg = S4RConfig(ratio=None, rank_k=width, rank_v=width, sample_tokens=None, recon_fraction=1.0,
                    key_space=key_space, granularity=granularity, buffer_tokens=8, fold_tokens=4,
                    coef_dtype="model", outlier_fraction=0.05)
    gen = torch.Generator().manual_seed(1)
    doc = torch.randint(0, 128, (400,), generator=gen).to(CUDA)
    cache = compressed(model, doc, cfg)
    assert cache.layers[0].out_idx.device.type == "cuda"
    ref = DynamicCache(config=model.config)
    with torch.inference_mode():
        model.set_attn_implementation("sdpa")
        model(input_ids=doc[None], cache=ref, use_cache=True)
        pos = doc.shape[0]
        for ids in [torch.randint(0, 128, (1, n), generator=gen).to(CUDA) for n in (12, 1, 1, 1, 1, 1, 15)]:
            model.set_attn_implementation("sdpa")
            positions = torch.arange(pos, pos + ids.shape[1], device=CUDA)[None]
            expected = model(input_ids=ids, position_ids=positions, cache=ref, use_cache=True).logits[0, -1]
            install(model)
            got = forward_tokens(model, cache, ids, pos)
            pos += ids.shape[1]
            assert ((got - expected).abs().max() / expected.abs().max()).item() < 1e-4


def test_default_method_decodes_in_bf16_on_cuda():
    model = tiny_model("qwen2", dtype=torch.bfloat16).to(CUDA)
    doc = torch.randint(0, 128, (600,), generator=torch.Generator().manual_seed(3)).to(CUDA)
    cache = compressed(model, doc, S4RConfig(ratio=5.0))
    assert cache.ratio() >= 5.0
    with torch.inference_mode():
        logits = [forward_tokens(model, cache, torch.tensor([[t]], device=CUDA), 600 + i)
                  for i, t in enumerate((5, 9, 17, 33))]
    assert all(x.isfinite().all() for x in logits)
    assert cache.logical_length() == 604


def test_random_weights_load_in_4bit_on_cuda():
    from s4r.models.random_quant import quantize_linears

    model = tiny_model("llama", dtype=torch.bfloat16).to(CUDA)
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(4)).to(CUDA)
    with torch.inference_mode():
        before = model(input_ids=ids).logits.float()
        assert quantize_linears(model, "4bit", torch.bfloat16, CUDA) == 2 * 7
        after = model(input_ids=ids).logits.float()
    assert type(model.model.layers[0].mlp.up_proj).__name__ == "Linear4bit"
    # NF4 changes the logits a little, not into noise
    assert torch.nn.functional.cosine_similarity(before.flatten(), after.flatten(), dim=0) > 0.9
