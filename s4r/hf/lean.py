"""The lean decode step: a model's one-token forward as a few large operations per layer.

transformers' eager forward runs about 40 small operations per layer outside attention, each a Python
dispatch, plus its module and keyword plumbing. The lean step runs the same arithmetic as one call
between two attention calls (`lean_ops.between_layers`: q/k/v as one product, gate/up as one), from
stacked weights in the dtype a one-token product reads fastest (`lean_weights`); uncompiled, a bf16
matrix takes its one token through `s4r.kernels.bf16_matvec` where the CPU has AVX512-BF16.
`S4R_COMPILE=1` compiles the operations with `torch.compile` where a C++ compiler exists (else eager,
said once in one line). Attention is untouched: each layer's `cache.update` and the registered
attention function get the queries, keys, values and keyword arguments the model's own forward gives
them.

`forward_tokens` takes the lean step for one-token steps of a supported model switched to s4r attention;
`S4R_DECODE_STEP=reference` (or `set_decode_step(model, "reference")`) keeps the model's own forward,
the reference the lean step is tested against.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from typing import Any

import torch

from s4r.hf import lean_ops
from s4r.hf.lean_weights import decode_weight_dtype, matrix_bytes, pack_layers, unsupported_reason
from s4r.kernels.bf16_matvec import matvec_weights

# "lean": compiled where `S4R_COMPILE=1` asks and a compiler allows; "lean-compiled"/"lean-eager" force
# either; "lean-torch": uncompiled with torch's products (the reference of the `bf16_matvec` kernel)
STEPS = ("lean", "lean-compiled", "lean-eager", "lean-torch", "reference")
STEP_ENV = "S4R_DECODE_STEP"
COMPILE_ENV = "S4R_COMPILE"  # "1": "lean" compiles its operations (first step: tens of seconds)
_ATTR = "_s4r_lean_steps"  # on the model: {(compiled?, matvec?): LeanStep}, or False when it cannot run
_said: set[str] = set()


def _say_once(line: str) -> None:
    """One line on stderr, once per process."""
    if line not in _said:
        _said.add(line)
        print(f"s4r: {line}", file=sys.stderr)


def set_decode_step(model, step: str) -> None:
    """Pick the one-token step of `model`: one of STEPS, "lean" by default, "reference" for the model's
    own forward."""
    if step not in STEPS:
        raise ValueError(f"decode step must be one of {', '.join(STEPS)}, got '{step}'")
    model._s4r_decode_step = step


def decode_step_setting(model) -> str:
    """The step chosen for `model`: `set_decode_step`, else `S4R_DECODE_STEP`, else "lean"."""
    step = getattr(model, "_s4r_decode_step", None) or os.environ.get(STEP_ENV, "lean").strip().lower()
    if step not in STEPS:
        _say_once(f"{STEP_ENV} must be one of {', '.join(STEPS)}, not '{step}'; using lean")
        return "lean"
    return step


def compiler_available() -> bool:
    """Whether torch.compile's CPU backend can build kernels here (it needs a C++ compiler)."""
    from torch._inductor import config as inductor_config

    cxx = inductor_config.cpp.cxx
    names = [c for c in (cxx if isinstance(cxx, tuple) else (cxx,)) if c] or ["g++"]
    return any(shutil.which(c) for c in names)


class _MaybeCompiled:
    """`fn` compiled on first use where it can be, else `fn` itself; a failure to compile is said in one
    line and the eager function kept."""

    def __init__(self, fn: Callable, compile_it: bool) -> None:
        self.fn = fn
        self.compiled = None
        if compile_it:
            self.compiled = torch.compile(fn, fullgraph=True, dynamic=False)

    def __call__(self, *args):
        if self.compiled is not None:
            try:
                return self.compiled(*args)
            except Exception as exc:  # noqa: BLE001 - any compiler failure: the eager function is exact
                self.compiled = None
                _say_once(f"torch.compile failed ({type(exc).__name__}: {str(exc).splitlines()[0][:120]}); "
                          "the decode step runs eager")
        return self.fn(*args)


def _want_compile(device: torch.device) -> bool:
    if os.environ.get(COMPILE_ENV, "0").strip().lower() not in ("1", "true", "yes"):
        return False
    if device.type == "cpu" and not compiler_available():
        _say_once("no C++ compiler for torch.compile; the decode step runs eager")
        return False
    return True


class LeanStep:
    """The lean one-token forward of a Llama-layout model (see the module docstring)."""

    def __init__(self, model, weight_dtype: torch.dtype | None = None,
                 compile_ops: bool | None = None, matvec: bool = True) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the lean decode step cannot run this model: {reason}")
        inner = model.model
        param = inner.embed_tokens.weight
        self.model = model
        self.weight_dtype = weight_dtype or decode_weight_dtype(param.dtype, param.device,
                                                                matrix_bytes(model))
        self.layers, self.head = pack_layers(model, self.weight_dtype)
        self.modules = [layer.self_attn for layer in inner.layers]
        self.eps = float(inner.norm.variance_epsilon)
        self.final_norm = inner.norm.weight.detach()
        first = self.modules[0]
        self.head_dim = int(first.head_dim)
        self.q_heads = first.q_proj.out_features // self.head_dim
        self.kv_heads = first.k_proj.out_features // self.head_dim
        # the keyword arguments each family's attention module passes its attention function
        self.attn_kwargs: dict[str, Any] = {}
        if model.config.model_type in ("mistral", "qwen2", "qwen3"):
            self.attn_kwargs["sliding_window"] = getattr(first, "sliding_window", None)
        compile_ops = _want_compile(param.device) if compile_ops is None else compile_ops
        self.compiled = compile_ops
        self.attention_inputs = _MaybeCompiled(lean_ops.attention_inputs, compile_ops)
        self.between_layers = _MaybeCompiled(lean_ops.between_layers, compile_ops)
        self.final_logits = _MaybeCompiled(lean_ops.final_logits, compile_ops)
        self._source = param.data_ptr()
        # uncompiled (and unless `matvec` is off), a bf16 matrix takes one token by the instruction kernel
        # (`bf16_matvec`); torch.compile traces torch's own product
        self.matvec = matvec and not compile_ops
        self.products = [w.with_matvec() for w in self.layers] if self.matvec else self.layers
        self.head_product = matvec_weights([self.head])[0] if self.matvec else self.head
        self.in_args = [w.input_args(self.eps) for w in self.products]
        self.out_args = [w.output_args(self.eps) for w in self.products]

    def matches(self, model) -> bool:
        """Whether this step still reads `model`'s weights (not moved or reloaded since it was built)."""
        return model is self.model and model.model.embed_tokens.weight.data_ptr() == self._source

    def __call__(self, cache, ids: torch.Tensor, start: int) -> torch.Tensor:
        """Forward `ids` [1, q] at positions start.. through the model with `cache`; logits [vocab] of
        the last position (in the model's dtype)."""
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        inner = self.model.model
        positions = torch.arange(start, start + ids.shape[1], device=ids.device).unsqueeze(0)
        h = inner.embed_tokens(ids)
        cos, sin = lean_ops.rope_tables(*inner.rotary_emb(h, position_ids=positions))
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.model.config._attn_implementation, None)
        kwargs = {"position_ids": positions, "use_cache": True}
        dims = (self.q_heads, self.kv_heads, self.head_dim)
        in_args, out_args, last = self.in_args, self.out_args, len(self.layers) - 1
        query, key, value = self.attention_inputs(h, *in_args[0], cos, sin, *dims)
        for i, module in enumerate(self.modules):
            keys, values = cache.update(key, value, i, kwargs=kwargs)
            out, _ = attention(module, query, keys, values, None, dropout=0.0, scaling=module.scaling,
                               **kwargs, **self.attn_kwargs)
            if i < last:
                h, query, key, value = self.between_layers(h, out, out_args[i], in_args[i + 1], cos, sin,
                                                           *dims)
            else:
                logits = self.final_logits(h, out, out_args[i], self.final_norm, self.eps,
                                           self.head_product)
        return logits[0, -1]


def lean_step(model, step: str | None = None) -> LeanStep | None:
    """The lean step of `model` (built on first use and kept on the model), or None where the model's own
    forward runs: the reference is chosen, the model is unsupported (said once where a lean step was asked
    for by name; the default falls back quietly, as nothing is lost), or it does not run s4r attention.
    `step` overrides the model's setting (`decode_step_setting`)."""
    asked = bool(step or getattr(model, "_s4r_decode_step", None) or os.environ.get(STEP_ENV))
    step = step or decode_step_setting(model)
    if step == "reference":
        return None
    from s4r.hf.attention import ATTN_NAME

    if getattr(model.config, "_attn_implementation", None) != ATTN_NAME:
        return None
    built = model.__dict__.setdefault(_ATTR, {})
    if built is False:
        return None
    compile_ops = {"lean-compiled": True, "lean-eager": False, "lean-torch": False}.get(step)
    if compile_ops is None:
        compile_ops = _want_compile(model.model.embed_tokens.weight.device)
    key = (compile_ops, step != "lean-torch")
    found = built.get(key)
    if found is not None and found.matches(model):
        return found
    reason = unsupported_reason(model)
    if reason is not None:
        if asked:
            _say_once(f"the lean decode step cannot run this model ({reason}); using its own forward")
        model.__dict__[_ATTR] = False
        return None
    found = built[key] = LeanStep(model, compile_ops=compile_ops, matvec=key[1])
    return found
