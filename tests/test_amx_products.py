"""The AMX tile product (`s4r.kernels.amx_products`) against `bf16_products.product`, its reference, on the
same words: whole and partial tiles of rows, columns and pairs, the padding it zeroes and the room it
checks; and the block step taking it where the CPU has AMX-BF16."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("numba")

from s4r.kernels import amx_products, bf16_products  # noqa: E402

pytestmark = pytest.mark.skipif(not amx_products.available(), reason="no AMX-BF16 here")


def _operands(rows: int, k: int, n: int) -> tuple[np.ndarray, np.ndarray, int, torch.Tensor]:
    """bf16 pair words of random left [rows, k] and right [k, n], NaN pairs in the room past them (a
    product reading them would show it), and the product of their bf16 roundings in fp64."""
    g = torch.Generator().manual_seed(rows * 10_000 + k * 100 + n)
    left, right = torch.randn(rows, k, generator=g), torch.randn(k, n, generator=g)
    pairs = (k + 1) // 2
    depth = -(-pairs // 16) * 16
    a = np.full((rows, depth), 0x7FC07FC0, np.uint32)
    b = np.full((depth, -(-n // 16) * 16), 0x7FC07FC0, np.uint32)
    bf16_products.pair_rows(left.numpy(), k, a)
    bf16_products.pair_columns(right.numpy(), k, b)
    return a, b, pairs, left.to(torch.bfloat16).double() @ right.to(torch.bfloat16).double()


@pytest.mark.parametrize("rows", [1, 16, 31, 32, 33, 90, 270])
@pytest.mark.parametrize("k,n", [(1, 1), (2, 16), (7, 17), (32, 32), (64, 48), (64, 1536), (33, 96),
                                 (1536, 112), (801, 90)])
@pytest.mark.parametrize("scale", [1.0, 0.125])
def test_tile_product_is_the_product_of_bf16_roundings(rows, k, n, scale):
    """Blocks of 32 x 32 sums stored straight into the output or through a partial block's copy, a last
    16 columns alone, rows past a multiple of 32, pairs past a multiple of 16 (zeroed over the NaNs): the
    fp32 sums of the rounded operands, as `bf16_products.product` gives them, nothing past column n."""
    a, b, pairs, exact = _operands(rows, k, n)
    want = scale * exact
    got = np.full((rows, n + 3), 7.0, np.float32)
    amx_products.product(a, b, pairs, scale, got, n)
    error = (torch.from_numpy(got[:, :n]).double() - want).abs().max()
    assert error <= 1e-5 * max(1.0, float(want.abs().max()))
    assert (got[:, n:] == 7.0).all()
    reference = np.zeros((rows, n), np.float32)
    bf16_products.product(a, b, pairs, scale, reference, n)
    assert np.abs(got[:, :n] - reference).max() <= 2e-5 * max(1.0, float(want.abs().max()))


@pytest.mark.parametrize("d", [48, 64])
def test_key_logits_take_tiles_only_for_head_dimensions_of_whole_tiles(d):
    """`key_pair_logits` with the tile product: a head dimension of whole tiles of pairs (64) on tiles,
    one that is not (48) through `vdpbf16ps`; both the reference's logits."""
    from s4r.core.rope import angle_parts
    from s4r.kernels.bf16_products import key_pair_logits

    g = torch.Generator().manual_seed(d)
    rotary = type("R", (), {"inv_freq": 10000.0 ** -(torch.arange(0, d, 2) / d), "attention_scaling": 1.0})
    coarse, fine = (t.numpy() for t in angle_parts(rotary, 2000))
    k, heads, rows = 70, 3, 40
    idx = torch.randperm(1500, generator=g)[:k].sort().values.numpy()
    keys = torch.randint(-3000, 3000, (1, k, heads * d), generator=g, dtype=torch.int32).numpy()
    col, row = torch.rand(1, heads * d, generator=g).numpy() * 1e-3, torch.rand(1, k, generator=g).numpy()
    q = torch.randn(heads, rows, d, generator=g).numpy()
    scratch: dict = {}

    def buffers(name, shape, dtype=torch.float32):
        return scratch.setdefault((name, shape), torch.zeros(shape, dtype=dtype).numpy())

    got, want = np.zeros((heads * rows, 80), np.float32), np.zeros((heads * rows, 80), np.float32)
    key_pair_logits(q, keys, idx, 5, coarse, fine, 0.125, col, row, got, buffers, amx_products.product)
    key_pair_logits(q, keys, idx, 5, coarse, fine, 0.125, col, row, want, buffers)
    assert np.abs(got[:, :k] - want[:, :k]).max() <= 1e-5 * max(1.0, np.abs(want[:, :k]).max())


def test_no_pairs_give_zero_sums():
    a, b = np.zeros((3, 16), np.uint32), np.zeros((16, 16), np.uint32)
    out = np.full((3, 5), 7.0, np.float32)
    amx_products.product(a, b, 0, 1.0, out, 4)
    assert (out[:, :4] == 0.0).all() and (out[:, 4] == 7.0).all()


def test_operands_without_room_for_whole_tiles_are_refused():
    """Pairs short of a multiple of 16 with no room to zero past them: refused, not read past the buffer."""
    a = np.zeros((4, 9), np.uint32)
    b = np.zeros((9, 16), np.uint32)
    with pytest.raises(ValueError, match="room"):
        amx_products.product(a, b, 9, 1.0, np.zeros((4, 16), np.float32), 16)


def test_a_bf16_block_takes_the_tile_product(monkeypatch):
    """A bf16 layer's block of queries multiplies on tiles where they are available, and gives the outputs
    of the same block through `vdpbf16ps` (`S4R_AMX=0`) within the fp32 order of additions."""
    import copy
    from dataclasses import replace

    from s4r.core.compress import compress_layer
    from tests.test_fused_kernels import CONFIGS, kv_data, rope_for, selected_sets, step_both

    cfg = replace(CONFIGS["pre-rope-int8-rebuild"], dense_queries=0)
    keys, values, queries = kv_data(3, 9, 700, torch.bfloat16)
    layer = compress_layer(keys, values, queries, cfg, cfg.rank_k, cfg.rank_v, rope_for(9, 3))
    twin = copy.deepcopy(layer)
    calls = []
    real = amx_products.product
    monkeypatch.setattr(amx_products, "product", lambda *a: calls.append(1) or real(*a))
    tiled, _, _ = step_both(layer, 9, 3, torch.bfloat16, positions=24)
    assert len(calls) >= 2, "the block's key logits and value rows took no tile product"
    monkeypatch.setenv("S4R_AMX", "0")
    calls.clear()
    paired, _, _ = step_both(twin, 9, 3, torch.bfloat16, positions=24)
    assert not calls
    assert selected_sets(layer) == selected_sets(twin)
    assert (tiled - paired).abs().max() <= 1e-4 * paired.abs().max()
