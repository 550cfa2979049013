"""A long bf16 query block's attention as two bf16 products per KV head around a softmax
(`s4r.hf.attention.block_attention`): transformers' eager arithmetic, checked against a float64
reference, the causal mask and the prefix, and the same rows whether the block is taken whole or in
chunks of query positions."""

from __future__ import annotations

import pytest
import torch

from s4r.hf import attention
from s4r.hf.attention import block_attention, causal_attention, causal_mask


def inputs(q_len: int, s_len: int, q_heads: int = 6, kv_heads: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(1, q_heads, q_len, 16, generator=g).bfloat16()
    key, value = (torch.randn(1, kv_heads, s_len, 16, generator=g).bfloat16() for _ in range(2))
    return query, key, value


def reference(query, key, value, scaling, prefix=None):
    """Exact attention in float64 over the bf16 inputs, the boolean causal mask."""
    group = query.shape[1] // key.shape[1]
    k, v = (t.double().repeat_interleave(group, dim=1) for t in (key, value))
    logits = torch.matmul(query.double(), k.transpose(-1, -2)) * scaling
    mask = causal_mask(query.shape[2], key.shape[2], prefix)
    logits = logits.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(logits, dim=-1), v)


@pytest.mark.parametrize("prefix", [None, 262])  # 262: ten of the block's own keys visible to all
@pytest.mark.parametrize("heads", [(6, 2), (4, 4)])
def test_block_attention_is_exact_attention_within_bf16_rounding(prefix, heads):
    query, key, value = inputs(48, 300, *heads)
    got = block_attention(query, key, value, 0.25, prefix=prefix)
    assert got.dtype == torch.bfloat16 and got.shape == query.shape
    want = reference(query, key, value, 0.25, prefix)
    # bf16 logits and probabilities, as transformers' eager attention rounds them
    assert (got.double() - want).abs().max() < 2e-2
    assert (got.double() - want).abs().mean() < 2e-3


def test_a_query_never_sees_the_blocks_later_tokens():
    query, key, value = inputs(40, 200)
    changed_k, changed_v = key.clone(), value.clone()
    changed_k[:, :, -10:] += 3.0  # the block's last ten own tokens
    changed_v[:, :, -10:] -= 3.0
    first = block_attention(query, key, value, 0.25)[:, :, :30]
    again = block_attention(query, changed_k, changed_v, 0.25)
    assert torch.equal(first, again[:, :, :30])
    assert not torch.equal(block_attention(query, key, value, 0.25)[:, :, 30:], again[:, :, 30:])


def test_a_block_taken_in_chunks_of_positions_gives_the_same_rows(monkeypatch):
    query, key, value = inputs(50, 260)
    whole = block_attention(query, key, value, 0.25)
    monkeypatch.setattr(attention, "BLOCK_LOGITS", 3 * 7 * 260)  # 7 positions a product
    assert torch.equal(block_attention(query, key, value, 0.25), whole)


def test_long_bf16_blocks_take_it_where_bf16_products_are_native(monkeypatch):
    query, key, value = inputs(48, 130)
    monkeypatch.setattr(attention, "native_bf16", lambda: True)
    assert torch.equal(causal_attention(query, key, value, 0.25), block_attention(query, key, value, 0.25))
    monkeypatch.setattr(attention, "native_bf16", lambda: False)
    sdpa = causal_attention(query, key, value, 0.25, sdpa_only=True)
    assert torch.equal(causal_attention(query, key, value, 0.25), sdpa)
    monkeypatch.setattr(attention, "native_bf16", lambda: True)
    assert torch.equal(causal_attention(query.float(), key.float(), value.float(), 0.25),
                       causal_attention(query.float(), key.float(), value.float(), 0.25, sdpa_only=True))
