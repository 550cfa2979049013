"""A prefill block's additive causal mask: the values SDPA made of the boolean mask, so the same outputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from s4r.hf.attention import additive_causal_mask, causal_attention, causal_mask


@pytest.mark.parametrize("q_len", [1, 2, 5, 40])
@pytest.mark.parametrize("extra", [0, 1, 3, 90])
def test_additive_mask_hides_what_the_boolean_mask_hides(q_len, extra):
    s_len = q_len + extra
    for prefix in {None, 0, max(0, extra - 2), extra, min(s_len, extra + 2)}:
        boolean = causal_mask(q_len, s_len, prefix)
        additive = additive_causal_mask(q_len, s_len, prefix, torch.bfloat16)
        if boolean is None:
            assert additive is None
            continue
        want = torch.zeros(q_len, s_len, dtype=torch.bfloat16).masked_fill_(~boolean, float("-inf"))
        assert torch.equal(additive, want), prefix


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prefix", [None, 20])
def test_prefill_attention_is_bit_identical_to_sdpa_with_the_boolean_mask(dtype, prefix):
    g = torch.Generator().manual_seed(0)
    query = torch.randn(1, 6, 48, 16, generator=g).to(dtype)
    key, value = (torch.randn(1, 2, 130, 16, generator=g).to(dtype) for _ in range(2))
    got = causal_attention(query, key, value, 0.25, prefix=prefix, sdpa_only=True)  # not `block_attention`
    want = F.scaled_dot_product_attention(query, key, value, attn_mask=causal_mask(48, 130, prefix),
                                          scale=0.25, enable_gqa=True)
    assert torch.equal(got, want)
