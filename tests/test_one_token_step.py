"""`s4r.kernels.one_token_step` (a post-RoPE layer's one-token step in three compiled calls) against
`s4r_step.attend` over bases, bands, head groupings and dtypes: the same tokens chosen, outputs within fp32
rounding (the compiler orders a few sums differently inside the larger calls); and a layer's step takes it
exactly where it applies."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from s4r.core.compress import compress_layer
from tests.test_fused_kernels import CONFIGS, D, kv_data, rope_for

pytest.importorskip("numba")

POST_ROPE = ["post-rope", "post-rope-int8", "post-rope-per-head", "post-rope-top120"]
# a fixed count just under a buffer bucket: the forced recent tokens come on top of it, past the bucket
CONFIGS = {**CONFIGS, "post-rope-top120": replace(CONFIGS["post-rope"], top_k=120, recon_drop=None)}


def compressed(name: str, q_heads: int, kv_heads: int, dtype: torch.dtype, tokens: int = 700):
    cfg = CONFIGS[name]
    keys, values, queries = kv_data(kv_heads, q_heads, tokens, dtype)
    return compress_layer(keys, values, queries, cfg, cfg.rank_k, cfg.rank_v, rope_for(q_heads, kv_heads))


@pytest.mark.parametrize("name", POST_ROPE)
@pytest.mark.parametrize("heads", [(9, 3), (4, 2), (2, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_token_step_is_the_general_step(name, heads, dtype):
    from s4r.kernels import one_token_step, s4r_step

    q_heads, kv_heads = heads
    layer = compressed(name, q_heads, kv_heads, dtype)
    g = torch.Generator().manual_seed(3)
    for step in range(3):  # the buffer grows: the exact tokens' count changes between steps
        new_k, new_v = (torch.randn(1, kv_heads, 1, D, generator=g).to(dtype) for _ in range(2))
        query = torch.randn(1, q_heads, 1, D, generator=g).to(dtype)
        layer.update(new_k, new_v)
        twin = copy.deepcopy(layer)
        views = s4r_step._views(layer)
        assert one_token_step.applies(views, query)
        out, lse = one_token_step.attend_one(layer, views, query, D ** -0.5)
        want_out, want_lse = s4r_step.attend([twin], query, D ** -0.5)[0]
        assert torch.equal(layer.selected, twin.selected), f"step {step}"
        torch.testing.assert_close(out, want_out, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(lse, want_lse, rtol=1e-6, atol=1e-6)
        assert (layer.rebuilt_tokens, layer.scored_tokens) == (twin.rebuilt_tokens, twin.scored_tokens)


@pytest.mark.parametrize("name", ["post-rope", "pre-rope"])
def test_a_layers_step_takes_the_one_token_step_only_where_it_applies(name, monkeypatch):
    from s4r.kernels import one_token_step

    calls = []
    real = one_token_step.attend_one
    monkeypatch.setattr(one_token_step, "attend_one", lambda *a: calls.append(1) or real(*a))
    layer = compressed(name, 4, 2, torch.float32)
    g = torch.Generator().manual_seed(5)
    for positions in (1, 3):
        new_k, new_v = (torch.randn(1, 2, positions, D, generator=g) for _ in range(2))
        layer.update(new_k, new_v)
        layer.attend(torch.randn(1, 4, positions, D, generator=g), None, None, D ** -0.5)
    assert len(calls) == (1 if name == "post-rope" else 0)
