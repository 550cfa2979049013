"""The coding oracle: the rate-distortion test channel and the exact-cache forks that hold coded tokens."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from research.coding_floor import gaussian_bound, stored_tokens
from research.coding_oracle import bound_coder, coded_tokens, exact_copy, gaussian_channel, oracle_forks
from s4r.config import S4RConfig
from s4r.core.budget import token_coef_bytes
from s4r.core.compress import compressible_parts
from s4r.runtime.session import Session
from tests.helpers import CharTokenizer, tiny_model
from tests.test_layerwise_compress_blocks import TEXT, layer_inputs, toy_rope


def gaussian_tokens(n: int, dim: int, seed: int = 0) -> torch.Tensor:
    """Gaussian vectors [n, dim] with a decaying spectrum in a random basis."""
    g = torch.Generator().manual_seed(seed)
    rotation, _ = torch.linalg.qr(torch.randn(dim, dim, generator=g))
    return (torch.randn(n, dim, generator=g) * torch.logspace(0, -3, dim).sqrt()) @ rotation.T


def relative_error(exact: torch.Tensor, coded: torch.Tensor) -> float:
    return float((exact.double() - coded.double()).pow(2).sum() / exact.double().pow(2).sum())


def eigenvalues(x: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return torch.linalg.eigvalsh(x.T @ x / x.shape[0])


@pytest.mark.parametrize("bits", [16.0, 64.0, 128.0])
def test_the_test_channel_reaches_the_bound_on_a_gaussian(bits):
    x = gaussian_tokens(8000, 32)
    coded = gaussian_channel(x, bits, torch.Generator().manual_seed(1))
    assert relative_error(x, coded) == pytest.approx(gaussian_bound(eigenvalues(x), bits), rel=0.05)


def test_no_bits_keep_nothing_and_many_bits_keep_the_tokens():
    x = gaussian_tokens(500, 16)
    assert gaussian_channel(x, 0.0, torch.Generator()).abs().max() < 1e-6
    assert relative_error(x, gaussian_channel(x, 1000.0, torch.Generator())) < 1e-6


def test_coded_tokens_code_the_basis_spaces_at_the_stored_bits_and_rotate_keys_back():
    keys, values, _ = layer_inputs(600)
    cfg = S4RConfig(ratio=8.0)
    code = bound_coder(torch.Generator().manual_seed(0))
    k_hat, v_hat = coded_tokens(keys, values, cfg, 6, 8, toy_rope, code)
    s = cfg.sinks
    assert k_hat.shape == keys[:, s:].shape and k_hat.dtype == keys.dtype
    # the keys are coded before RoPE, at the bits a token's key coefficients take there
    k_pre, _ = compressible_parts(keys, values, cfg, toy_rope)
    coded_pre, _ = compressible_parts(torch.cat([keys[:, :s], k_hat], 1), values, cfg, toy_rope)
    bits = 8 * token_coef_bytes(cfg, 6, keys.element_size())
    bound = gaussian_bound(eigenvalues(k_pre[0]), bits)
    assert relative_error(k_pre[0], coded_pre[0]) == pytest.approx(bound, rel=0.15)
    # with bits to spare the coded tokens are the tokens (at the positions RoPE put them)
    k_all, v_all = coded_tokens(keys, values, cfg, 64, 64, toy_rope, bound_coder(torch.Generator()))
    assert relative_error(keys[:, s:].float(), k_all.float()) < 1e-3
    assert relative_error(values[:, s:].float(), v_all.float()) < 1e-3
    assert relative_error(values[:, s:].float(), v_hat.float()) > 1e-3


def test_exact_forks_hold_the_replaced_tokens_and_keep_the_sinks():
    loaded = SimpleNamespace(model=tiny_model("llama", num_hidden_layers=2), tokenizer=CharTokenizer(),
                             name="tiny", device="cpu", dtype=torch.float32, context_length=4096)
    staged = Session(loaded, method="full")
    staged.ingest(TEXT, compress=False)
    before = [layer.keys_view.clone() for layer in staged.cache.layers]
    s4r = staged.fork(method="s4r", ratio=4.0)
    forks = oracle_forks(staged, s4r, 0)
    stored = forks["stored"]
    assert set(forks) == {"stored", "bound", "charged", "vector", "scalar", "vector-values"}
    sinks = s4r.cache.layers[0].sinks
    for i, layer in enumerate(staged.cache.layers):
        keys, values = layer.keys_view[0], layer.values_view[0]
        assert torch.equal(layer.keys_view, before[i])  # the staged tokens are untouched
        want_k, want_v = stored_tokens(s4r.cache.layers[i], keys, values)
        got = stored.cache.layers[i]
        assert torch.equal(got.keys_view[0, :, sinks:], want_k)
        assert torch.equal(got.values_view[0, :, sinks:], want_v)
        # the values alone recoded: s4r's keys as stored
        assert torch.equal(forks["vector-values"].cache.layers[i].keys_view[0, :, sinks:], want_k)
        for fork in forks.values():
            assert torch.equal(fork.cache.layers[i].keys_view[0, :, :sinks], keys[:, :sinks])
        for name in ("bound", "vector", "scalar", "vector-values"):
            coded = forks[name].cache.layers[i].values_view[0, :, sinks:]
            assert coded.shape == values[:, sinks:].shape
            assert not torch.equal(coded, values[:, sinks:])
    # a fork that replaces nothing answers as the exact cache
    same = exact_copy(staged, lambda i, k, v: (k[:, sinks:], v[:, sinks:]), sinks)
    full = staged.fork(method="full", ratio=1.0)
    assert same.ask("what?", max_new_tokens=6)[0] == full.ask("what?", max_new_tokens=6)[0]


def test_the_channel_codes_only_the_components_it_is_given():
    x = gaussian_tokens(2000, 16)
    top4 = gaussian_channel(x, 200.0, torch.Generator(), components=4)
    eig, vec = torch.linalg.eigh(x.double().T @ x.double() / x.shape[0])
    kept = x.double() @ vec[:, -4:] @ vec[:, -4:].T  # the top 4 components, exact at 200 bits
    assert relative_error(kept, top4) < 1e-6 and relative_error(x, top4) > 0.1


def test_charging_the_bases_costs_bits():
    keys, values, _ = layer_inputs(600)
    cfg = S4RConfig(ratio=8.0)
    s = cfg.sinks
    free, paid = (coded_tokens(keys, values, cfg, 6, 8, toy_rope,
                               bound_coder(torch.Generator().manual_seed(0), charge_bases=charge))
                  for charge in (False, True))
    for exact, a, b in zip((keys[:, s:], values[:, s:]), free, paid, strict=True):
        assert relative_error(exact.float(), a.float()) < relative_error(exact.float(), b.float())
