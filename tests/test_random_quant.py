"""Random-weight models with bitsandbytes weights (`--random-weights --quant`), on the CPU here."""

from __future__ import annotations

import pytest
import torch

from s4r.errors import DeviceError
from s4r.models.random_quant import quantize_linears
from tests.helpers import tiny_model

bnb = pytest.importorskip("bitsandbytes")


def test_every_linear_but_the_head_becomes_4bit_and_the_logits_stay_close():
    model = tiny_model("llama", dtype=torch.bfloat16)
    ids = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        before = model(input_ids=ids).logits.float()
        replaced = quantize_linears(model, "4bit", torch.bfloat16, torch.device("cpu"))
        after = model(input_ids=ids).logits.float()
    # 2 layers x (q, k, v, o, gate, up, down)
    assert replaced == 14
    assert all(isinstance(layer.self_attn.q_proj, bnb.nn.Linear4bit) for layer in model.model.layers)
    assert isinstance(model.lm_head, torch.nn.Linear) and not isinstance(model.lm_head, bnb.nn.Linear4bit)
    assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.uint8  # stored packed, 2 codes a byte
    cos = torch.nn.functional.cosine_similarity(before.flatten(), after.flatten(), dim=0)
    assert 0.9 < cos < 1.0  # quantized (not the same weights), not noise


def test_an_unknown_quantization_is_refused():
    with pytest.raises(ValueError, match="8bit or 4bit"):
        quantize_linears(tiny_model("llama"), "3bit", torch.float32, torch.device("cpu"))


def test_a_missing_bitsandbytes_is_one_clear_error(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_bnb(name, *args, **kwargs):
        if name == "bitsandbytes":
            raise ImportError("No module named 'bitsandbytes'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_bnb)
    with pytest.raises(DeviceError, match="needs bitsandbytes"):
        quantize_linears(tiny_model("llama"), "4bit", torch.float32, torch.device("cpu"))
