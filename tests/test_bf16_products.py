"""The bf16 pair products a prompt's block takes in a bf16 model (`s4r.kernels.bf16_products`) against the
same products of the operands rounded to bf16 in torch, and the block step with them against the step with
fp32 products."""

from __future__ import annotations

import copy
import types
from dataclasses import replace

import numpy as np
import pytest
import torch

pytest.importorskip("numba")

from s4r.kernels import bf16_products  # noqa: E402

pytestmark = pytest.mark.skipif(not bf16_products.available(), reason="no AVX512-BF16 here")


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).double()


def _words(x: torch.Tensor) -> np.ndarray:
    """x [..., 2n] as uint32 words of bf16 pairs along its last axis (torch's rounding)."""
    bits = x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).astype(np.uint32)
    return bits[..., 0::2] | (bits[..., 1::2] << np.uint32(16))


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9, 69])
@pytest.mark.parametrize("k,n", [(0, 20), (1, 1), (2, 16), (7, 17), (9, 40), (64, 64), (33, 96), (40, 112),
                                 (130, 113), (1536, 130)])
def test_product_is_the_product_of_bf16_roundings(rows, k, n):
    """Rows in runs of four and alone, columns in runs of 64 and a last run of 16, 32, 48 or 64 (whole or
    partial), odd lengths (a zero pair closes them): the fp32 sums of the rounded operands, nothing
    written past column n."""
    g = torch.Generator().manual_seed(rows * 1000 + k + n)
    left, right = torch.randn(rows, k, generator=g), torch.randn(k, n, generator=g)
    pairs, width = (k + 1) // 2, -(-n // 16) * 16
    a = np.full((rows, pairs), 0xFFFFFFFF, np.uint32)
    b = np.full((pairs, width), 0xFFFFFFFF, np.uint32)
    bf16_products.pair_rows(left.numpy(), k, a)
    bf16_products.pair_columns(right.numpy(), k, b)
    out = np.full((rows, n + 5), 7.0, np.float32)
    bf16_products.product(a, b, pairs, 0.25, out, n)
    want = 0.25 * _bf16(left) @ _bf16(right)
    error = (torch.from_numpy(out[:, :n]).double() - want).abs().max()
    assert error <= 1e-5 * max(1.0, float(want.abs().max()))
    assert (out[:, n:] == 7.0).all()
    assert np.array_equal(b[:, n:], np.zeros_like(b[:, n:]))


def test_pairs_round_as_torch_and_close_odd_lengths_with_zero():
    x = torch.randn(3, 9) * torch.logspace(-3, 3, 9)
    a = np.zeros((3, 5), np.uint32)
    bf16_products.pair_rows(x.numpy(), 9, a)
    assert np.array_equal(a, _words(torch.cat([x, torch.zeros(3, 1)], 1)))
    b = np.zeros((5, 16), np.uint32)
    bf16_products.pair_columns(x.T.contiguous().numpy(), 9, b)
    assert np.array_equal(b[:, :3], a.T)


@pytest.mark.parametrize("d,width", [(64, 192), (64, 64), (128, 256), (24, 48)])
@pytest.mark.parametrize("k", [37, 48])
def test_rotate_key_pairs_are_the_rotated_keys_in_bf16_pairs(d, width, k):
    """`rotate_key_pairs` writes `rotate_keys`' keys, rounded, as pairs of consecutive columns with the
    tokens along the rows, zero for the tokens past k up to a multiple of 16 (what `product` reads)."""
    from s4r.core.rope import angle_parts
    from s4r.kernels.query_blocks import rotate_keys

    g = torch.Generator().manual_seed(d + width + k)
    rotary = types.SimpleNamespace(inv_freq=10000.0 ** -(torch.arange(0, d, 2) / d), attention_scaling=1.0)
    coarse, fine = (t.numpy() for t in angle_parts(rotary, 4000))
    idx = torch.randperm(3000, generator=g)[:k].sort().values.numpy()
    keys = torch.randint(-3000, 3000, (2, k + 3, width), generator=g, dtype=torch.int32).numpy()
    col, row = torch.rand(2, width, generator=g).numpy(), torch.rand(2, k, generator=g).numpy()
    rotated = np.zeros((2, k, width), np.float32)
    rotate_keys(keys, idx, k, 5, coarse, fine, col, row, rotated)
    pairs = np.full((2, width // 2, 64), 0xFFFFFFFF, np.uint32)
    bf16_products.rotate_key_pairs(keys, idx, k, 5, coarse, fine, col, row, pairs)
    assert np.array_equal(pairs[:, :, :k], _words(torch.from_numpy(rotated)).transpose(0, 2, 1))
    whole = -(-k // 16) * 16
    assert (pairs[:, :, k:whole] == 0).all() and (pairs[:, :, whole:] == 0xFFFFFFFF).all()


@pytest.mark.parametrize("name,positions", [("pre-rope-int8-rebuild", 20), ("pre-rope-int8-rebuild", 40),
                                            ("pre-rope-model-rebuild", 20), ("per-head-bases", 20)])
def test_a_bf16_block_with_pair_products_is_the_block_with_fp32_products(name, positions, monkeypatch):
    """A bf16 layer's block of queries (int8 or bf16 rebuilt keys, one basis a layer or a head): the same
    tokens chosen with either product, and outputs within the bf16 rounding of the keys, the probabilities
    and the value rows (`vdpbf16ps` even where AMX tiles would take them: `tests/test_amx_products.py`)."""
    monkeypatch.setenv("S4R_AMX", "0")
    from s4r.core.compress import compress_layer
    from tests.test_fused_kernels import CONFIGS, kv_data, rope_for, selected_sets, step_both

    q_heads, kv_heads = 9, 3
    cfg = replace(CONFIGS[name], dense_queries=0)
    keys, values, queries = kv_data(kv_heads, q_heads, 700, torch.bfloat16)
    layer = compress_layer(keys, values, queries, cfg, cfg.rank_k, cfg.rank_v, rope_for(q_heads, kv_heads))
    twin = copy.deepcopy(layer)
    calls = []
    real = bf16_products.product
    monkeypatch.setattr(bf16_products, "product", lambda *a: calls.append(1) or real(*a))
    paired, _, _ = step_both(layer, q_heads, kv_heads, torch.bfloat16, positions=positions)
    assert calls, "the block took no bf16 pair product"
    monkeypatch.setenv("S4R_BF16_PRODUCTS", "0")
    calls.clear()
    plain, _, _ = step_both(twin, q_heads, kv_heads, torch.bfloat16, positions=positions)
    assert not calls
    assert selected_sets(layer) == selected_sets(twin)
    assert (paired - plain).abs().max() <= 0.02 * plain.abs().max()
