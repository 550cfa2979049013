"""The selected keys rebuilt by int8 dot-product instructions (`s4r.kernels.vnni_keys`) against their
reference: the integer product of the decoded rows and the basis codes, then `rotated_key_logits`."""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("numba")

from s4r.kernels import vnni_keys  # noqa: E402

needs_vnni = pytest.mark.skipif(not vnni_keys.available(), reason="this CPU has no AVX512-VNNI")


def test_packed_basis_starts_each_column_at_minus_128_times_its_codes():
    codes = torch.tensor([[[1, -2], [3, 4], [-5, 6]]], dtype=torch.int8)  # [G=1, r=3, W=2]
    packed, start = vnni_keys.pack_basis(codes)
    assert packed.shape == (1, 1, 2, 4) and packed.dtype.name == "int8"
    assert packed[0, 0].tolist() == [[1, 3, -5, 0], [-2, 4, 6, 0]]  # a column's four ranks side by side
    assert start.dtype.name == "int32" and start.tolist() == [[128, -1024]]


@needs_vnni
@pytest.mark.parametrize("groups,rank,width,d", [(1, 76, 192, 64), (1, 13, 96, 32), (3, 30, 64, 64),
                                                (3, 5, 32, 32), (1, 24, 256, 128)])
@pytest.mark.parametrize("k", [1, 15, 16, 17, 100])
@pytest.mark.parametrize("parts", [1, 3])
def test_vnni_key_logits_kernel_is_the_int8_product_then_rotated_key_logits(groups, rank, width, d, k, parts):
    """Basis widths of whole and partial 64-column runs, ranks past and on a multiple of four, a layer
    basis shared by its heads and one per head, token counts around the tile and odd ones, the tokens in
    one run or split into runs of whole tiles (some empty): the same integer sums, rotation and dots, so
    the same logits, bit for bit in one run (the parallel build sums the dots in another order)."""
    from s4r.core.rope import angle_parts
    from s4r.kernels.rotated_keys import rotated_key_logits

    g = torch.Generator().manual_seed(rank * k + width)
    heads = width // d if groups == 1 else groups
    rotary = types.SimpleNamespace(inv_freq=10000.0 ** -(torch.arange(0, d, 2) / d), attention_scaling=1.0)
    coarse, fine = (t.numpy() for t in angle_parts(rotary, 4000))
    basis = torch.randint(-127, 128, (groups, rank, width), generator=g, dtype=torch.int8)
    packed, start = vnni_keys.pack_basis(basis)
    quads = packed.shape[1]
    codes = torch.randint(-127, 128, (groups, k + 3, 4 * quads), generator=g, dtype=torch.int8)  # bytes past
    idx = torch.randperm(3000, generator=g)[:k].sort().values  # the rank are read, and must cancel
    q = torch.randn(heads, 3, d, generator=g)
    col, row = torch.rand(groups, width, generator=g) / 1e3, torch.rand(groups, k + 3, generator=g) / 1e2
    out = torch.full((3 * heads, k + 2), float("nan"))
    tiles = torch.zeros(parts, groups, vnni_keys.TILE, width, dtype=torch.int32)
    vnni_keys.vnni_key_logits(q.numpy(), codes.numpy(), packed, start, idx.numpy(), k, 4, coarse, fine, 0.125,
                              col.numpy(), row.numpy(), out.numpy(), tiles.numpy(), parts)
    sums = torch.matmul(codes[:, :k, :rank].long(), basis.long()).int()
    want = torch.full_like(out, float("nan"))
    rotated_key_logits(q.numpy(), sums.numpy(), idx.numpy(), k, 4, coarse, fine, 0.125, col.numpy(),
                       row.numpy(), want.numpy())
    if parts == 1:
        assert torch.equal(out[:, :k], want[:, :k])
    else:
        torch.testing.assert_close(out[:, :k], want[:, :k], rtol=1e-6, atol=1e-7)
    assert out[:, k:].isnan().all()  # nothing written past the selected tokens


@needs_vnni
def test_the_step_rebuilds_int8_keys_through_vnni_where_the_cpu_has_it():
    """An int8-rebuild layer of a basis width the kernel takes keeps its packed basis for the step (so the
    fused-step tests of `test_fused_kernels` run this kernel on such a CPU)."""
    from s4r.core.compress import compress_layer
    from s4r.kernels.s4r_step import _views
    from tests.test_fused_kernels import CONFIGS, kv_data, rope_for

    cfg = CONFIGS["pre-rope-int8-rebuild"]
    keys, values, queries = kv_data(3, 9, 300, torch.float32)
    layer = compress_layer(keys, values, queries, cfg, cfg.rank_k, cfg.rank_v, rope_for(9, 3))
    assert _views(layer).packed is not None


@pytest.mark.parametrize("block", [64, 2048])
def test_without_vnni_the_int8_product_path_is_the_eager_step(block, monkeypatch):
    """Where the CPU lacks VNNI (or numba's target is named), oneDNN's product and the rotation serve the
    step, a block of selected tokens at a time."""
    from s4r.core.compress import compress_layer
    from s4r.kernels import s4r_step
    from tests.test_fused_kernels import CONFIGS, kv_data, rope_for, selected_sets, step_both

    monkeypatch.setattr(vnni_keys, "available", lambda: False)
    monkeypatch.setattr(s4r_step, "BLOCK", block)
    cfg = CONFIGS["pre-rope-int8-rebuild"]
    keys, values, queries = kv_data(3, 9, 700, torch.float32)
    layer = compress_layer(keys, values, queries, cfg, cfg.rank_k, cfg.rank_v, rope_for(9, 3))
    fused, eager, twin = step_both(layer, 9, 3, torch.float32)
    assert s4r_step._views(layer).packed is None and layer.selected.shape[-1] > 3 * 64
    assert selected_sets(layer) == selected_sets(twin)
    torch.testing.assert_close(fused, eager, rtol=1e-4, atol=1e-4)


def test_instructions_are_never_assumed_for_a_target_numba_is_told_to_compile_for(monkeypatch):
    """NUMBA_CPU_NAME (or NUMBA_CPU_FEATURES) may name a CPU without the host's instructions: then neither
    the VNNI nor the bf16 kernels run, whatever the host has."""
    from s4r.kernels import bf16_products, jit

    monkeypatch.setattr(jit, "_state", {"warned": False, "failed": False})  # nothing found out yet
    monkeypatch.setenv("NUMBA_CPU_NAME", "generic")
    assert not vnni_keys.available() and not bf16_products.available()
