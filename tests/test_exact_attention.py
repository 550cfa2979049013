"""The full cache's fused one-token attention (`s4r.kernels.exact_attention`) against its reference,
`causal_attention` over the same bf16 keys and values, and the full cache's decode step with it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("numba")

from s4r.hf.attention import causal_attention  # noqa: E402
from s4r.kernels import exact_attention, jit  # noqa: E402
from s4r.kernels.scratch import Scratch  # noqa: E402
from s4r.layers.full import FullLayer  # noqa: E402
from tests.helpers import counted_kernel, failing_kernel  # noqa: E402
from tests.test_lean_step import _decode, _model  # noqa: E402

pytestmark = pytest.mark.skipif(not exact_attention.available(), reason="no AVX512-BF16 here")


def _operands(heads: int, group: int, width: int, tokens: int, seed: int, spare: int = 7):
    """A query [1, H*G, 1, D] and keys/values [1, H, tokens, D] viewed in buffers with `spare` rows more
    (a cache's capacity), keys of very different sizes so some logits dominate and some cancel."""
    g = torch.Generator().manual_seed(seed)
    keys = (torch.randn(1, heads, tokens + spare, width, generator=g) * 2).bfloat16()
    values = torch.randn(1, heads, tokens + spare, width, generator=g).bfloat16()
    query = torch.randn(1, heads * group, 1, width, generator=g).bfloat16()
    return query, keys[:, :, :tokens], values[:, :, :tokens]


def _reference(query, key, value, scaling):
    """The exact attention in fp64 of the same bf16 operands (what both the kernel and SDPA round)."""
    heads, group = key.shape[1], query.shape[1] // key.shape[1]
    q = query.double().view(heads, group, -1)
    logits = torch.einsum("hgd,htd->hgt", q, key[0].double()) * scaling
    out = torch.einsum("hgt,htd->hgd", logits.softmax(-1), value[0].double())
    return out.reshape(1, heads * group, 1, -1)


@pytest.mark.parametrize("parts", [1, 2, 3])
@pytest.mark.parametrize("tokens", [1, 15, 16, 17, 255, 256, 257, 300, 1100])
@pytest.mark.parametrize("shape", [(3, 3, 64), (1, 1, 64), (2, 2, 128), (2, 5, 64), (1, 8, 64)])
def test_the_kernel_is_exact_attention(shape, tokens, parts, monkeypatch):
    """Groups of 1-8 query rows (runs of four and the rest), 64 and 128 columns, keys in whole runs of 16,
    blocks of 256 and the rest, each head's tokens split into ranges whose softmaxes merge (and empty
    ranges where there are fewer tokens than parts)."""
    monkeypatch.setattr(jit, "parts", lambda: parts)
    heads, group, width = shape
    query, key, value = _operands(heads, group, width, tokens, tokens * 10 + parts)
    got = exact_attention.fused_decode_attention(query, key, value, 0.125, Scratch())
    want = _reference(query, key, value, 0.125)
    assert got.shape == query.shape and got.dtype == torch.bfloat16
    # the bf16 output's rounding, plus the fp32 sums' order and fast_exp's error
    assert ((got.double() - want).abs() <= 2.0**-8 * want.abs() + 2e-4).all()


def test_the_kernel_is_no_further_from_exact_than_the_eager_paths():
    """At a decode step's length, against fp64: SDPA and the eager products (whose probabilities are
    rounded to bf16) are each at least as far off as the kernel."""
    query, key, value = _operands(3, 3, 64, 7600, 0)
    exact = _reference(query, key, value, 0.125)
    got = exact_attention.fused_decode_attention(query, key, value, 0.125, Scratch())
    err = (got.double() - exact).abs().max().item()
    for sdpa_only in (False, True):
        eager = causal_attention(query, key, value, 0.125, sdpa_only=sdpa_only)
        assert err <= (eager.double() - exact).abs().max().item()


def test_only_one_bf16_token_over_whole_64_column_heads_takes_the_kernel():
    query, key, _ = _operands(2, 2, 64, 20, 1)
    assert exact_attention.fusable(query, key)
    assert not exact_attention.fusable(query.float(), key.float())
    assert not exact_attention.fusable(query.expand(1, 4, 2, 64), key)  # two query tokens
    narrow, narrow_key, _ = _operands(2, 2, 80, 20, 1)
    assert not exact_attention.fusable(narrow, narrow_key)
    assert not exact_attention.fusable(query, key.transpose(-1, -2).contiguous().transpose(-1, -2))


def _layer(tokens: int, heads: int = 2, width: int = 64) -> tuple[FullLayer, torch.Tensor, torch.Tensor]:
    layer = FullLayer()
    _, key, value = _operands(heads, 1, width, tokens, 3)
    keys, values = layer.update(key.contiguous(), value.contiguous())
    return layer, keys, values


def test_the_full_cache_takes_the_kernel_for_its_own_keys(monkeypatch):
    layer, keys, values = _layer(40)
    query = torch.randn(1, 4, 1, 64).bfloat16()
    calls = counted_kernel(monkeypatch, exact_attention, "decode_attention")
    got = layer.attend(query, keys, values, 0.125)
    assert calls == [1]
    want = _reference(query, keys, values, 0.125)
    assert ((got.double() - want).abs() <= 2.0**-8 * want.abs() + 2e-4).all()
    layer.attend(query, keys.clone(), values, 0.125)  # keys the layer did not hand over: the eager path
    assert calls == [1]


def test_a_failing_kernel_falls_back_to_the_eager_path_once(monkeypatch):
    calls = failing_kernel(monkeypatch, exact_attention, "decode_attention")
    layer, keys, values = _layer(30)
    query = torch.randn(1, 2, 1, 64).bfloat16()
    want = causal_attention(query, keys, values, 0.125)
    for _ in range(2):
        torch.testing.assert_close(layer.attend(query, keys, values, 0.125), want, rtol=0, atol=0)
    assert calls == [1] and jit._state["failed"]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_full_cache_decodes_as_its_eager_attention_does(arch, monkeypatch):
    """A bf16 model with 64-column heads decoding over the full cache: the kernel ran every layer of every
    step, and the logits are the eager attention's (S4R_KERNELS=eager) up to bf16 steps."""
    model = _model(arch, dtype=torch.bfloat16, head_dim=64)
    calls = counted_kernel(monkeypatch, exact_attention, "decode_attention")
    got = _decode(model, "lean-eager")
    steps, layers = got.shape[0], model.config.num_hidden_layers
    assert len(calls) == steps * layers
    monkeypatch.setenv("S4R_KERNELS", "eager")
    reference = _decode(model, "lean-eager")
    assert len(calls) == steps * layers
    err = (got.float() - reference.float()).abs().max().item()
    assert err < 0.02 * reference.float().abs().max().item()
