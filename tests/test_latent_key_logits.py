"""`s4r.kernels.sparse_attention.latent_key_logits` (post-RoPE keys' logits on the selected tokens, the query
rows as vector lanes) against the band decoder and a plain product: row counts below, at and past one
vector of rows, one basis or one per head, bands whose width is not a multiple of the kernel's sums, no
bands at all."""

from __future__ import annotations

import pytest
import torch

from tests.test_fused_kernels import random_bands

pytest.importorskip("numba")


@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("per_group", [1, 3, 16, 20])
@pytest.mark.parametrize("tails", [((4, 32), (2, 32)), ((4, 36), (2, 36)), ((4, 6), (2, 4)), ((2, 8),), ()])
def test_latent_key_logits_kernel_is_lead_logits_plus_decoded_bands_times_queries(groups, per_group, tails):
    from s4r.core.band_plan import BandPlan
    from s4r.core.coef_bands import decode_tails
    from s4r.kernels.jit import as_numpy
    from s4r.kernels.sparse_attention import latent_key_logits

    lead, n, off = 12, 300, 7
    _, _, tail_codes, tail_steps = random_bands(tails, groups=groups, n=n, lead=lead)
    plan = BandPlan(lead, tails)
    g = torch.Generator().manual_seed(per_group)
    rows = groups * per_group
    idx = torch.randperm(n, generator=g)[:45].sort().values
    k = idx.shape[0]
    qfull = torch.randn(rows, plan.rank, generator=g)
    logits = torch.randn(rows, off + n + 3, generator=g)
    out = torch.full((rows, k + 9), float("nan"))
    scaling = 0.125
    latent_key_logits(logits.numpy(), off, idx.numpy(), k, qfull.numpy(), lead, scaling, tail_codes.numpy(),
                      as_numpy(tail_steps), torch.tensor([b for b, _ in tails], dtype=torch.int64).numpy(),
                      torch.tensor([w for _, w in tails], dtype=torch.int64).numpy(), out.numpy())
    want = logits[:, off + idx].clone()
    if tails:
        decoded = decode_tails(tail_codes[:, idx], tail_steps[:, idx], plan)  # [G, k, width]
        q = qfull[:, lead:].reshape(groups, per_group, -1) * scaling
        want += torch.matmul(q.double(), decoded.double().transpose(1, 2)).reshape(rows, k).float()
    torch.testing.assert_close(out[:, :k], want, rtol=1e-5, atol=1e-5)
    assert out[:, k:].isnan().all(), "wrote past the selected tokens"
