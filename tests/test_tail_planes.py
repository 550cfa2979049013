"""Lower coefficient bands used as byte planes give what the decoded bands give."""

from __future__ import annotations

import pytest
import torch

from s4r.core.coef_bands import decode_tails, encode_tails, plan_bands
from s4r.core.tail_planes import PlanarTail, decode_planar, planar_basis, plane_map, plane_order


@pytest.mark.parametrize(("rank", "spec"), [(96, "8:2,4:3,2:3"), (13, "8:1,4:3,2:4"), (64, "8:1,4:1"),
                                            (40, "8:1,2:1")])
@pytest.mark.parametrize("groups", [1, 3])
def test_planes_give_the_decoded_bands_logits_and_weighted_sums(rank, spec, groups):
    heads, stored, k = 3, 50, 11
    g = torch.Generator().manual_seed(rank + groups)
    plan = plan_bands(rank, spec)
    codes, steps = encode_tails(torch.randn(groups, stored, rank, generator=g), plan, torch.bfloat16)
    idx = torch.randint(0, stored, (1 if groups == 1 else heads, k), generator=g)
    decoded = decode_tails(codes, steps, plan)  # [G, N, w], the reference
    rows = decoded[0][idx] if groups == 1 else torch.gather(
        decoded, 1, idx.unsqueeze(-1).expand(-1, -1, decoded.shape[-1]))
    rows = rows.expand(heads, -1, -1)
    q = torch.randn(heads, 4, rank - plan.lead, generator=g)
    probs = torch.rand(heads, 4, k, generator=g)

    tail = PlanarTail.gather(codes, steps, idx, plan)
    # planes carry whole bytes (up to 255 steps) that the map then cancels: fp32 rounding ~1e-4
    torch.testing.assert_close(tail.logits(q), q @ rows.transpose(1, 2), atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(tail.weighted(probs), probs @ rows, atol=1e-3, rtol=1e-3)


def test_the_plane_map_recovers_every_code_of_every_byte():
    plan = plan_bands(24, "8:1,4:1,2:1")  # lead 8, then 8 four-bit and 8 two-bit columns
    byte = torch.arange(256, dtype=torch.uint8)
    codes = torch.stack([byte, byte, byte, byte, byte, byte], dim=-1)[None]  # [1, 256, 4 + 2 bytes]
    steps = torch.ones(1, 256, plan.tail_count)
    tail = PlanarTail.gather(codes, steps, torch.arange(256)[None], plan)
    decoded = tail.planes[0].T @ plane_map(plan, "cpu")  # [256, 16]
    torch.testing.assert_close(decoded, decode_tails(codes, steps, plan)[0])
    assert decoded[255, 0] == 7.5 and decoded[0, 8] == -1.5  # mid-rise levels at both ends


def test_no_selected_token_gives_empty_products():
    plan = plan_bands(32, "8:1,4:1,2:1")
    codes, steps = encode_tails(torch.randn(1, 10, 32), plan, torch.float32)
    tail = PlanarTail.gather(codes, steps, torch.zeros(1, 0, dtype=torch.long), plan)
    assert tail.logits(torch.randn(3, 2, 32 - plan.lead)).shape == (3, 2, 0)
    assert torch.all(tail.weighted(torch.rand(3, 2, 0)) == 0)


@pytest.mark.parametrize(("rank", "spec"), [(96, "8:2,4:3,2:3"), (13, "8:1,4:3,2:4"), (64, "8:1,4:1"),
                                            (40, "8:1,2:1")])
def test_planar_decoding_is_the_decoded_bands_in_plane_order(rank, spec):
    """`decode_planar` holds `decode_tails`' values, token axis last, in `plane_order`, and the basis
    reordered by `planar_basis` turns them into the same keys; every byte value decodes."""
    g = torch.Generator().manual_seed(rank)
    plan = plan_bands(rank, spec)
    codes, steps = encode_tails(torch.randn(1, 300, rank, generator=g), plan, torch.bfloat16)
    codes[0, :256] = torch.arange(256, dtype=torch.uint8)[:, None]  # every byte at every position
    width = rank - plan.lead
    out = decode_planar(codes, steps, plan, torch.empty(1, width, 300))
    reference = decode_tails(codes, steps, plan)  # [1, N, w]
    order = list(plane_order(plan))
    assert sorted(order) == list(range(width))
    torch.testing.assert_close(out, reference[..., order].transpose(1, 2), rtol=0, atol=0)
    blocks = torch.randn(2, 8, rank, generator=g)
    lead = torch.randn(1, plan.lead, 300, generator=g)
    keys = torch.matmul(planar_basis(blocks, plan), torch.cat([lead, out], dim=1))
    expected = torch.matmul(blocks, torch.cat([lead, reference.transpose(1, 2)], dim=1))
    torch.testing.assert_close(keys, expected, rtol=1e-5, atol=1e-5)
