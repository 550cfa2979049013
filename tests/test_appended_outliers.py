"""Text appended to a compressed layer (a second document, a long chat) keeps its own exact outliers."""

from __future__ import annotations

import torch

from s4r.config import S4RConfig
from s4r.core.compress import compress_layer


def _in_subspace(basis: torch.Tensor, heads: int, tokens: int, dim: int,
                 gen: torch.Generator) -> torch.Tensor:
    """[heads, tokens, dim] vectors whose concatenated heads lie in `basis`'s span."""
    flat = torch.randn(tokens, basis.shape[1], generator=gen) @ basis.T
    return flat.view(tokens, heads, dim).transpose(0, 1).contiguous()


def test_a_rare_token_in_an_appended_document_stays_exact():
    gen = torch.Generator().manual_seed(0)
    heads, dim, rank = 2, 16, 6
    basis, _ = torch.linalg.qr(torch.randn(heads * dim, rank, generator=gen))
    keys, values = (_in_subspace(basis, heads, 400, dim, gen) for _ in range(2))
    cfg = S4RConfig(key_space="post_rope",
                    ratio=None, rank_k=rank, rank_v=rank, outlier_fraction=0.05, coef_dtype="model",
                    buffer_tokens=64, fold_tokens=32)
    layer = compress_layer(keys, values, None, cfg, rank, rank, None)
    stored_before = layer.stored_coefs
    # a 300-token appended document in the same subspace, but for one token the bases cannot represent
    new_k, new_v = (_in_subspace(basis, heads, 300, dim, gen) for _ in range(2))
    needle = 137
    new_k[:, needle] = torch.randn(heads, dim, generator=gen) * 3
    new_v[:, needle] = torch.randn(heads, dim, generator=gen) * 3
    layer.update(new_k.unsqueeze(0), new_v.unsqueeze(0))
    layer.fold_buffer()  # what an appended document's ingest does once the layer holds it
    at = stored_before + needle  # the needle's index among the stored coefficients
    assert at in layer.out_idx.tolist()
    slot = layer.out_idx.tolist().index(at)
    torch.testing.assert_close(layer.out_k[:, slot], new_k[:, needle])
    torch.testing.assert_close(layer.out_v[:, slot], new_v[:, needle])
    # the outlier share of the appended text is the configured one, and the buffer kept the newest tokens
    assert layer.out_idx.numel() == cfg.outlier_count(400 - cfg.sinks) + cfg.outlier_count(300 - 64)
    torch.testing.assert_close(layer.buf_k, new_k[:, -64:])
    assert layer.stored_length() == 700 and layer.logical == 700
