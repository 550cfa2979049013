"""A block of queries (a question's prompt) through the fused step's selection against the eager step's:
one selection for every query of the block, each query masked from the block's later tokens."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from s4r.config import S4RConfig
from s4r.core.compress import compress_layer
from s4r.core.rope import shifted
from s4r.kernels import jit
from s4r.layers.segments import SegmentedLayer
from tests.test_fused_kernels import CONFIGS, D, kv_data, rope_for, selected_sets, step_both

pytest.importorskip("numba")


@pytest.mark.parametrize("name", ["pre-rope", "pre-rope-int8-rebuild", "pre-rope-model-rebuild",
                                  "post-rope", "per-head-bases"])
@pytest.mark.parametrize("positions", [2, 6, 40])  # the rows' own kernels, products, past the window
def test_a_block_of_queries_is_the_eager_block(name, positions):
    if positions > CONFIGS[name].query_window and CONFIGS[name].key_space == "post_rope":
        pytest.skip("post-RoPE blocks past the scoring window run the eager step")
    q_heads, kv_heads = 9, 3
    cfg = replace(CONFIGS[name], dense_queries=0)
    keys, values, queries = kv_data(kv_heads, q_heads, 700, torch.float32)
    layer = compress_layer(keys, values, queries, cfg, cfg.rank_k, cfg.rank_v, rope_for(q_heads, kv_heads))
    fused, eager, twin = step_both(layer, q_heads, kv_heads, torch.float32, positions=positions)
    assert fused.shape == (1, q_heads, positions, D)
    assert selected_sets(layer) == selected_sets(twin)
    torch.testing.assert_close(fused, eager, rtol=1e-4, atol=1e-4)
    assert layer.rebuilt_tokens == twin.rebuilt_tokens and layer.logical == twin.logical


@pytest.mark.parametrize("name", ["pre-rope", "post-rope"])
def test_a_prompt_window_scores_the_blocks_last_queries_in_both_steps(name):
    """`prompt_window` picks the rows that score a block's selection, alike in the fused and the eager step;
    post-RoPE keys take every row's logits from the scoring, so there every row still scores."""
    q_heads, kv_heads = 9, 3
    keys, values, queries = kv_data(kv_heads, q_heads, 700, torch.float32)
    rope, chosen = rope_for(q_heads, kv_heads), {}
    for window in (2, 32):
        cfg = replace(CONFIGS[name], dense_queries=0, prompt_window=window)
        assert cfg.scoring_queries(12) == (min(window, 12) if name == "pre-rope" else 12)
        layer = compress_layer(keys, values, queries, cfg, cfg.rank_k, cfg.rank_v, rope)
        fused, eager, twin = step_both(layer, q_heads, kv_heads, torch.float32, positions=12)
        assert selected_sets(layer) == selected_sets(twin)
        torch.testing.assert_close(fused, eager, rtol=1e-4, atol=1e-4)
        chosen[window] = selected_sets(layer)
    assert (chosen[2] != chosen[32]) == (name == "pre-rope")


@pytest.mark.parametrize("key_space", ["pre_rope", "post_rope"])
def test_a_block_over_segments_is_the_eager_block(key_space):
    q_heads, kv_heads = 9, 3
    rope = rope_for(q_heads, kv_heads)
    cfg = S4RConfig(ratio=None, rank_k=24, rank_v=24, pool_kernel=1, key_space=key_space, dense_queries=0)
    k1, v1, q1 = kv_data(kv_heads, q_heads, 600, torch.float32, seed=3)
    k2, v2, q2 = kv_data(kv_heads, q_heads, 500, torch.float32, seed=4)
    first = compress_layer(k1, v1, q1, cfg, 24, 24, rope)
    second = compress_layer(k2, v2, q2, replace(cfg, sinks=0), 20, 20, shifted(rope, 600))
    layer = SegmentedLayer([first, second])
    fused, eager, twin = step_both(layer, q_heads, kv_heads, torch.float32, positions=4)
    assert selected_sets(layer) == selected_sets(twin)
    torch.testing.assert_close(fused, eager, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_block_over_a_long_buffer_is_the_eager_block(dtype):
    """A document's block through the selection: hundreds of its own tokens still exact in the buffer, whose
    logits and values the fused step takes as products (`EXACT_PRODUCT`)."""
    from s4r.kernels.query_blocks import EXACT_PRODUCT

    q_heads, kv_heads = 9, 3
    cfg = replace(CONFIGS["pre-rope"], dense_queries=0, buffer_tokens=512)
    keys, values, queries = kv_data(kv_heads, q_heads, 700, dtype)
    layer = compress_layer(keys, values, queries, cfg, cfg.rank_k, cfg.rank_v, rope_for(q_heads, kv_heads))
    g = torch.Generator().manual_seed(5)
    layer.update(torch.randn(1, kv_heads, 300, D, generator=g).to(dtype),
                 torch.randn(1, kv_heads, 300, D, generator=g).to(dtype))
    fused, eager, twin = step_both(layer, q_heads, kv_heads, dtype, positions=20)
    assert twin.exact_length >= EXACT_PRODUCT
    if dtype == torch.float32:
        assert selected_sets(layer) == selected_sets(twin)
        torch.testing.assert_close(fused, eager, rtol=1e-4, atol=1e-4)
    else:
        assert (fused - eager).abs().max() < 0.05 * eager.abs().max()


def test_the_first_query_of_a_block_does_not_see_the_later_ones():
    """Changing the block's later tokens leaves the first query's output as it was (every stored token
    rebuilt, so that the later queries' scores cannot move the selection the block shares)."""
    cfg = replace(CONFIGS["pre-rope"], dense_queries=0, recon_fraction=1.0, recon_cap=1.0, recon_drop=None,
                  recon_token_cap=0, local_window=0)
    keys, values, queries = kv_data(3, 9, 700, torch.float32)
    layer = compress_layer(keys, values, queries, cfg, cfg.rank_k, cfg.rank_v, rope_for(9, 3))
    other = copy.deepcopy(layer)
    g = torch.Generator().manual_seed(5)
    new_k, new_v = torch.randn(1, 3, 3, D, generator=g), torch.randn(1, 3, 3, D, generator=g)
    query = torch.randn(1, 9, 3, D, generator=g)
    layer.update(new_k, new_v)
    changed_k, changed_v = new_k.clone(), new_v.clone()
    changed_k[:, :, 1:] += 5.0
    changed_v[:, :, 1:] -= 5.0
    other.update(changed_k, changed_v)
    first = layer.attend(query, None, None, D ** -0.5)[:, :, 0]
    again = other.attend(query, None, None, D ** -0.5)[:, :, 0]
    assert not jit._state["failed"]
    torch.testing.assert_close(first, again, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["pre-rope", "post-rope"])
def test_a_block_past_the_window_is_fused_where_keys_are_rebuilt(name):
    """Post-RoPE keys take every row's logits from the scoring, which covers only the window's rows."""
    from s4r.kernels.s4r_step import usable

    cfg = replace(CONFIGS[name], dense_queries=0)
    keys, values, queries = kv_data(3, 9, 400, torch.float32)
    layer = compress_layer(keys, values, queries, cfg, cfg.rank_k, cfg.rank_v, rope_for(9, 3))
    window = layer.cfg.query_window
    assert usable(layer, torch.zeros(1, 9, window, D))
    assert usable(layer, torch.zeros(1, 9, window + 1, D)) == (name == "pre-rope")


@pytest.mark.parametrize("positions", [1, 3])
def test_query_rows_kernel_folds_positions_as_the_eager_step(positions):
    import numpy as np

    from s4r.kernels.jit import as_numpy
    from s4r.kernels.latent_scoring import query_rows

    query = torch.randn(1, 6, positions, 8, generator=torch.Generator().manual_seed(2)).bfloat16()
    out = np.zeros((2, 3 * positions, 8), np.float32)
    query_rows(as_numpy(query), out)
    want = query[0].reshape(2, 3 * positions, 8).float()  # `LowRankLayer.exact_step`'s fold
    assert torch.equal(torch.from_numpy(out), want)


@pytest.mark.parametrize("positions", [1, 4])
def test_project_queries_kernel_unrotates_each_query_at_its_own_position(positions):
    """The int8 lead coefficients of a block's queries, each chunk's: the eager step's `_latent_query`
    within the int8 rounding (half a step of each row's scale)."""
    import numpy as np

    from s4r.kernels.latent_scoring import project_queries, query_rows
    from s4r.kernels.query_rotations import query_rotations
    from s4r.kernels.s4r_step import _views

    cfg = replace(CONFIGS["pre-rope"], dense_queries=0, rope_chunk=128)
    keys, values, queries = kv_data(3, 9, 700, torch.float32)
    layer = compress_layer(keys, values, queries, cfg, cfg.rank_k, cfg.rank_v, rope_for(9, 3))
    g = torch.Generator().manual_seed(3)
    layer.update(torch.randn(1, 3, positions, D, generator=g), torch.randn(1, 3, positions, D, generator=g))
    query = torch.randn(1, 9, positions, D, generator=g)
    qf = query[0].reshape(3, 3 * positions, D)
    want, bounds = layer._latent_query(qf, positions)  # [C, H, rows, rk]
    v, n = _views(layer), layer._n
    undo, cos_q, sin_q, ccos, csin, got_bounds = query_rotations(layer, v, n, D, positions)
    assert list(got_bounds) == list(bounds) and len(bounds) > 2
    q = np.zeros((3, 3 * positions, D), np.float32)
    query_rows(query.numpy(), q)
    chunks, rows = ccos.shape[0], 9 * positions
    q8, qscale = np.zeros((chunks, rows, v.lead), np.int8), np.zeros((chunks, rows), np.float32)
    project_queries(q, cos_q, sin_q, undo, ccos, csin, v.blocks_k, v.lead, 1.0, q8, qscale,
                    np.zeros((rows, 0), np.float32))
    got = torch.from_numpy(q8.astype(np.float32) * qscale[..., None])
    lead = want[..., : v.lead].reshape(chunks, rows, v.lead)
    assert ((got - lead).abs() <= 0.5 * torch.from_numpy(qscale)[..., None] + 1e-5).all()


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., d] rotated as RoPE rotates (x cos + rotate_half(x) sin), in float64."""
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x.double() * cos.double() + turned.double() * sin.double()


@pytest.mark.parametrize("d,width", [(64, 192), (64, 64), (128, 256), (24, 48)])
@pytest.mark.parametrize("scaled", [False, True])
def test_rotate_keys_kernel_turns_each_key_to_its_position(d, width, scaled):
    """The head sizes with their own loops and one without, int32 sums with their scales and plain keys:
    each selected key rotated to its position (`angle_parts`' two rows composed, within their rounding)."""
    import types

    import numpy as np

    from s4r.core.rope import angle_parts
    from s4r.kernels.query_blocks import rotate_keys

    g = torch.Generator().manual_seed(d + width)
    groups, k, pos0 = 2, 37, 5
    rotary = types.SimpleNamespace(inv_freq=10000.0 ** -(torch.arange(0, d, 2) / d), attention_scaling=1.0)
    coarse, fine = (t.numpy() for t in angle_parts(rotary, 4000))
    idx = torch.randperm(3000, generator=g)[:k].sort().values
    if scaled:
        keys = torch.randint(-3000, 3000, (groups, k + 3, width), generator=g, dtype=torch.int32)
        col, row = torch.rand(groups, width, generator=g), torch.rand(groups, k, generator=g)
        plain = keys[:, :k].double() * col[:, None].double() * row[..., None].double()
    else:
        keys = torch.randn(groups, k + 3, width, generator=g)
        col, row = torch.zeros(groups, 0), torch.zeros(groups, 0)
        plain = keys[:, :k].double()
    out = np.zeros((groups, k, width), np.float32)
    rotate_keys(keys.numpy(), idx.numpy(), k, pos0, coarse, fine, col.numpy(), row.numpy(), out)
    angles = (idx + pos0).double()[:, None] * rotary.inv_freq.double()[None, :]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    want = _rotated(plain.view(groups, k, width // d, d), cos[:, None], sin[:, None]).view(groups, k, width)
    scale = plain.abs().amax()
    assert (torch.from_numpy(out).double() - want).abs().max() <= 2e-3 * scale


@pytest.mark.parametrize("d", [64, 128, 24])
def test_project_queries_kernel_for_each_head_size(d):
    """Un-rotated from each query's own angles, turned by each chunk's, projected on each KV head's block
    of the key basis: the int8 codes within half a step of the fp64 product, the last chunk's fp32 row."""
    import numpy as np

    from s4r.kernels.latent_scoring import project_queries

    g = torch.Generator().manual_seed(d)
    heads, positions, group, rk, lead, chunks = 3, 4, 3, 20, 7, 2
    rows = group * positions
    q = torch.randn(heads, rows, d, generator=g)
    blocks = torch.randn(heads, rk, d, generator=g)

    def angles(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.rand(n, d // 2, generator=g) * 6
        return torch.cat([a.cos()] * 2, -1), torch.cat([a.sin()] * 2, -1)

    (cos_q, sin_q), (ccos, csin) = angles(positions), angles(chunks)
    q8, qscale = np.zeros((chunks, heads * rows, lead), np.int8), np.zeros((chunks, heads * rows), np.float32)
    qfull = np.zeros((heads * rows, rk), np.float32)
    project_queries(q.numpy(), cos_q.numpy(), sin_q.numpy(), True, ccos.numpy(), csin.numpy(), blocks.numpy(),
                    lead, 0.5, q8, qscale, qfull)
    pos = torch.arange(rows) % positions
    back = _rotated(q, cos_q[pos], -sin_q[pos])  # cos^2 + sin^2 = 1: the inverse rotation
    for c in range(chunks):
        want = torch.einsum("hmd,hrd->hmr", _rotated(back, ccos[c], csin[c]), blocks.double())
        want = want.reshape(heads * rows, rk)
        got = torch.from_numpy(q8[c]).double() * torch.from_numpy(qscale[c]).double()[:, None] / 0.5
        half_step = torch.from_numpy(qscale[c]).double()[:, None] / 0.5 / 2 + 1e-4
        assert ((got - want[:, :lead]).abs() <= half_step).all()
    torch.testing.assert_close(torch.from_numpy(qfull).double(), want, rtol=1e-4, atol=1e-4)


def test_add_value_basis_product_is_the_kernel():
    """The block path's value-basis products give `add_value_basis`' sums."""
    import numpy as np

    from s4r.kernels.query_blocks import add_value_basis_product
    from s4r.kernels.step_output import add_value_basis

    g = torch.Generator().manual_seed(0)
    heads, rows, rank, d = 3, 40, 37, 64
    z, basis = torch.randn(heads * rows, rank, generator=g), torch.randn(heads, rank, d, generator=g)
    start = torch.randn(heads, rows, d, generator=g)
    want, got = start.numpy().copy(), start.numpy().copy()
    add_value_basis(z.numpy(), basis.numpy(), want)
    add_value_basis_product(z.numpy(), basis.numpy(), got)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
