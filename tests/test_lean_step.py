"""The lean decode step against the model's own forward (the reference) on tiny random models."""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface

from s4r.core.budget import KVShape
from s4r.core.rope import model_rope_fn
from s4r.hf import attention as attn_mod
from s4r.hf import lean
from s4r.hf.attention import install
from s4r.hf.cache import CompressedCache
from s4r.hf.generation import forward_tokens
from s4r.hf.lean_weights import BF16_MIN_BYTES, decode_weight_dtype
from s4r.methods import CompressContext, make_method
from tests.helpers import tiny_model

PROMPT, STEPS = 40, 8


def _decode(model, step: str | None, method: str = "full", ratio: float = 1.0,
            prompt: int = PROMPT) -> torch.Tensor:
    """Logits of STEPS one-token steps after a `prompt`-token prefill (`method` compresses it)."""
    ids = torch.randint(3, 120, (1, prompt + STEPS), generator=torch.Generator().manual_seed(0))
    shape = KVShape.from_config(model.config, 4)
    cache = CompressedCache(shape.layers, shape)
    out = []
    with torch.inference_mode():
        forward_tokens(model, cache, ids[:, :prompt], 0)
        make_method(method, ratio).compress(cache, CompressContext(model_rope_fn(model), ratio))
        for t in range(prompt, prompt + STEPS):
            out.append(forward_tokens(model, cache, ids[:, t : t + 1], t, step=step))
    return torch.stack(out)


def _model(arch: str, **overrides):
    model = tiny_model(arch, **overrides)
    install(model)
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2", "mistral"])
def test_lean_logits_match_the_reference(arch):
    model = _model(arch)
    reference = _decode(model, "reference")
    torch.testing.assert_close(_decode(model, "lean-eager"), reference, atol=2e-5, rtol=1e-5)
    # the stacked weights took over the modules' storage: the model's own forward is unchanged
    torch.testing.assert_close(_decode(model, "reference"), reference, atol=0, rtol=0)
    assert model.model.layers[0].self_attn.q_proj.weight.data_ptr() == \
        lean.lean_step(model, "lean-eager").layers[0].w_qkv.data_ptr()


def test_lean_logits_match_the_reference_through_a_compressed_cache():
    model = _model("qwen3")
    reference = _decode(model, "reference", "s4r", 2.5, prompt=900)
    torch.testing.assert_close(_decode(model, "lean-eager", "s4r", 2.5, prompt=900), reference, atol=2e-5,
                               rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bf16_matrices_stay_close_to_the_reference(arch):
    model = _model(arch)
    reference = _decode(model, "reference")
    step = lean.LeanStep(model, weight_dtype=torch.bfloat16)
    model.__dict__[lean._ATTR] = {(False, True): step}
    assert step.layers[0].w_qkv.dtype == torch.bfloat16
    got = _decode(model, "lean-eager")
    err = (got - reference).abs().max().item()
    # bf16 rounding of weights and inputs: about 1% of the logits' scale, far below a wrong layout's error
    assert err < 0.02 * reference.abs().max().item()


def _spy(model, step: str):
    """What each layer's cache.update and attention function get in one decode step."""
    seen = []

    class SpyCache(CompressedCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            seen.append(("update", layer_idx, key_states.clone(), value_states.clone(),
                         sorted(kwargs["kwargs"]), kwargs["kwargs"]["position_ids"].tolist()))
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def spy_attention(module, query, key, value, mask, **kwargs):
        seen.append(("attention", module.layer_idx, query.clone(), mask, sorted(kwargs),
                     kwargs["position_ids"].tolist(), kwargs["scaling"]))
        return attn_mod.s4r_attention(module, query, key, value, mask, **kwargs)

    shape = KVShape.from_config(model.config, 4)
    cache = SpyCache(shape.layers, shape)
    ids = torch.arange(3, 3 + PROMPT + 1).unsqueeze(0)
    AttentionInterface.register(attn_mod.ATTN_NAME, spy_attention)
    try:
        with torch.inference_mode():
            forward_tokens(model, cache, ids[:, :PROMPT], 0, step="reference")
            seen.clear()
            forward_tokens(model, cache, ids[:, PROMPT:], PROMPT, step=step)
    finally:
        AttentionInterface.register(attn_mod.ATTN_NAME, attn_mod.s4r_attention)
    return seen


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cache_update_and_attention_see_what_the_reference_gives_them(arch):
    model = _model(arch)
    reference, got = _spy(model, "reference"), _spy(model, "lean-eager")
    assert len(got) == len(reference) == 2 * model.config.num_hidden_layers
    for ours, theirs in zip(got, reference, strict=True):
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs, strict=True):
            if isinstance(a, torch.Tensor):
                assert a.shape == b.shape
                torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)
            else:
                assert a == b


def test_a_wrong_qkv_order_is_caught():
    model = _model("llama")
    reference = _decode(model, "reference")
    step = lean.LeanStep(model, weight_dtype=torch.float32)
    nq = model.config.num_attention_heads * model.config.head_dim
    nk = model.config.num_key_value_heads * model.config.head_dim
    for w in step.layers:  # keys and values swapped in the stack: what a packing bug would do
        w.w_qkv = torch.cat([w.w_qkv[:nq], w.w_qkv[nq + nk :], w.w_qkv[nq : nq + nk]])
    step.in_args = [w.input_args(step.eps) for w in step.layers]
    model.__dict__[lean._ATTR] = {(False, True): step}
    assert not torch.allclose(_decode(model, "lean-eager"), reference, atol=1e-3)


def test_the_reference_setting_and_unsupported_models_run_the_models_own_forward(monkeypatch, capsys):
    model = _model("llama")
    calls = []
    monkeypatch.setattr(lean.LeanStep, "__call__", lambda self, *a: calls.append(1))
    lean.set_decode_step(model, "reference")
    _decode(model, None)
    assert not calls
    with pytest.raises(ValueError, match="decode step"):
        lean.set_decode_step(model, "fast")
    gelu = _model("llama", hidden_act="gelu")
    assert lean.lean_step(gelu, "lean") is None
    assert "cannot run this model (activation 'gelu' is not silu)" in capsys.readouterr().err
    monkeypatch.delenv(lean.STEP_ENV, raising=False)
    lean._said.clear()  # the line above was said once already
    quiet = _model("llama", hidden_act="gelu")
    assert lean.lean_step(quiet) is None  # the default falls back without a word
    assert capsys.readouterr().err == ""


def test_a_bad_step_name_in_the_environment_is_said_and_lean_used(monkeypatch, capsys):
    monkeypatch.setenv(lean.STEP_ENV, "quick")
    assert lean.decode_step_setting(_model("llama")) == "lean"
    assert "S4R_DECODE_STEP must be one of" in capsys.readouterr().err


def test_no_compiler_or_a_failed_compile_falls_back_to_eager(monkeypatch, capsys):
    monkeypatch.setenv(lean.COMPILE_ENV, "1")
    monkeypatch.setattr(lean, "compiler_available", lambda: False)
    assert lean._want_compile(torch.device("cpu")) is False
    assert "no C++ compiler for torch.compile" in capsys.readouterr().err

    def broken(*args):
        raise RuntimeError("cannot find cl.exe")

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: broken)
    wrapped = lean._MaybeCompiled(lambda x: x + 1, compile_it=True)
    assert wrapped(1) == 2 and wrapped.compiled is None
    assert "torch.compile failed (RuntimeError: cannot find cl.exe)" in capsys.readouterr().err


def test_large_fp32_models_decode_from_bf16_matrices_on_cpu():
    cpu = torch.device("cpu")
    assert decode_weight_dtype(torch.float32, cpu, BF16_MIN_BYTES) == torch.bfloat16
    assert decode_weight_dtype(torch.float32, cpu, BF16_MIN_BYTES - 1) == torch.float32
    assert decode_weight_dtype(torch.bfloat16, cpu, 10 * BF16_MIN_BYTES) == torch.bfloat16
    assert decode_weight_dtype(torch.float32, torch.device("cuda"), 10 * BF16_MIN_BYTES) == torch.float32
