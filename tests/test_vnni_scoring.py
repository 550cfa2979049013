"""Every stored token scored by int8 dot-product instructions (`s4r.kernels.vnni_scoring`) against its
reference, `latent_scoring.latent_logits`: the same integer sums and scalings, so the same logits."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("numba")

from s4r.kernels import vnni_scoring  # noqa: E402

needs_vnni = pytest.mark.skipif(not vnni_scoring.available(), reason="this CPU has no AVX512-VNNI")


@needs_vnni
@pytest.mark.parametrize("groups,rows,lead", [(1, 9, 24), (1, 16, 130), (1, 17, 7), (1, 1, 1), (3, 3, 13),
                                              (8, 2, 3), (2, 5, 33)])
@pytest.mark.parametrize("n,spare", [(5, 0), (100, 0), (517, 3), (1300, 40)])
@pytest.mark.parametrize("parts", [1, 3])
def test_vnni_latent_logits_is_latent_logits_bit_for_bit(groups, rows, lead, n, spare, parts):
    """Query rows in runs of 4 to 16 (and past 16), lead bands on and off a multiple of four, a layer
    basis and one per head, chunk bounds off the 16-token runs, runs that end at the band's capacity
    (copied) or before it, an offset, the tokens split into runs (some empty): equal logits, nothing
    written outside the stored tokens."""
    from s4r.kernels.jit import as_numpy
    from s4r.kernels.latent_scoring import latent_logits

    g = torch.Generator().manual_seed(n * lead + rows)
    chunks, off = 3, 5
    nrows = rows * groups if groups > 1 else rows
    q8 = torch.randint(-127, 128, (chunks, nrows, lead), generator=g, dtype=torch.int8)
    qscale = torch.rand(chunks, nrows, generator=g)
    ck = torch.randint(-128, 128, (groups, lead, n + spare), generator=g, dtype=torch.int8)
    sk = as_numpy(torch.rand(groups, n + spare, generator=g).to(torch.bfloat16))
    bounds = torch.tensor([0, n // 3, n // 3 + 1, n]).numpy()
    want = torch.full((nrows, off + n + 2), float("nan"))
    got = want.clone()
    latent_logits(q8.numpy(), qscale.numpy(), bounds, ck.numpy(), sk, n, rows, want.numpy(), off, 1)
    vnni_scoring.vnni_latent_logits(q8.numpy(), qscale.numpy(), bounds, ck.numpy(), sk, n, rows, got.numpy(),
                                    off, parts)
    assert torch.equal(got[:, off : off + n], want[:, off : off + n])
    assert got[:, :off].isnan().all() and got[:, off + n :].isnan().all()


@needs_vnni
def test_the_step_scores_through_vnni_where_the_cpu_has_it_with_the_same_selection(monkeypatch):
    """A fused step with the VNNI scoring and one with `latent_logits` choose the same tokens and give the
    same output (so the fused-step tests of `test_fused_kernels` run this kernel on such a CPU)."""
    from s4r.core.compress import compress_layer
    from s4r.kernels import s4r_step
    from tests.test_fused_kernels import CONFIGS, kv_data, rope_for, selected_sets, step_both

    cfg = CONFIGS["pre-rope-int8-rebuild"]
    keys, values, queries = kv_data(3, 9, 700, torch.float32)
    rope = rope_for(9, 3)
    layers = [compress_layer(keys, values, queries, cfg, cfg.rank_k, cfg.rank_v, rope) for _ in range(2)]
    with_vnni = step_both(layers[0], 9, 3, torch.float32)[0]
    assert s4r_step._views(layers[0]).vnni_scoring
    monkeypatch.setattr(vnni_scoring, "available", lambda: False)
    without = step_both(layers[1], 9, 3, torch.float32)[0]
    assert not s4r_step._views(layers[1]).vnni_scoring
    assert selected_sets(layers[0]) == selected_sets(layers[1])
    assert torch.equal(with_vnni, without)
