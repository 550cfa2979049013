"""`offline`: Palu-like bases fitted once on calibration text and reused for every prompt.

It shows what S4R's per-prompt bases buy: the storage, ranks and sparse decoding are S4R's, only the
bases come from other text (by default the first ~2k tokens of Romeo and Juliet), so how well they
fit a given document depends on how much it resembles the calibration text.

A calibration is registered per model shape and basis settings, so methods built later by name (as
`Session.fork` does) find it: calibrate once, then compress any number of prompts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from s4r.config import S4RConfig
from s4r.core.budget import KVShape, group_shape
from s4r.core.compress import LayerBases, compress_layer, fit_layer_bases
from s4r.core.rope import model_rope_fn
from s4r.errors import S4RError
from s4r.hf.attention import install
from s4r.hf.cache import CompressedCache
from s4r.hf.generation import prefill
from s4r.layers.full import staged_tensors
from s4r.methods.base import CompressContext
from s4r.methods.s4r import S4RMethod, plan_ranks

CALIBRATION_BOOK = "romeo-and-juliet"
CALIBRATION_TOKENS = 2048


def default_calibration_text() -> str:
    """The calibration text used when none is given: Romeo and Juliet, shipped in the package."""
    from s4r.books import load_book  # lazy: only the default text needs the books

    return load_book(CALIBRATION_BOOK)


def basis_key(shape: KVShape, cfg: S4RConfig) -> tuple:
    """What calibrated bases depend on: the attention shape (not the dtype) and the fitting settings."""
    return (shape.layers, shape.kv_heads, shape.q_heads, shape.head_dim, cfg.sinks, cfg.key_space,
            cfg.granularity, cfg.normalize, cfg.sample_tokens, cfg.recent_share)


@dataclass
class Calibration:
    """Per-layer bases of the calibration keys and values at full width, with each column's energy.

    The rank-r basis of an SVD is its first r singular vectors, so one decomposition serves every
    rank the solver may ask for; `bases` slices a layer once per (rank_k, rank_v) and keeps the result,
    so every prompt compressed at those ranks shares the very same tensors.
    """

    key: tuple
    tokens: int
    layers: list[LayerBases]  # full width, columns by singular value, energies of the calibration sample
    _bases: dict[tuple[int, int, int], LayerBases] = field(default_factory=dict)

    def energies(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer (K, V) energy per basis column: what the energy rank allocation spreads ranks by."""
        return [(b.energy_k, b.energy_v) for b in self.layers]

    def bases(self, layer: int, rank_k: int, rank_v: int) -> LayerBases:
        """Layer `layer`'s leading `rank_k` key and `rank_v` value columns (contiguous, cached)."""
        key = (layer, rank_k, rank_v)
        if key not in self._bases:
            full = self.layers[layer]
            self._bases[key] = LayerBases(full.k[..., :rank_k].contiguous(),
                                          full.v[..., :rank_v].contiguous())
        return self._bases[key]


# calibrations by `basis_key`, so a method built by name after `calibrate` finds its bases
_REGISTRY: dict[tuple, Calibration] = {}


def registered_calibration(shape: KVShape, cfg: S4RConfig) -> Calibration | None:
    """The calibration registered for this shape and these settings, if any."""
    return _REGISTRY.get(basis_key(shape, cfg))


def clear_calibrations() -> None:
    """Forget every registered calibration (tests, or to free the memory)."""
    _REGISTRY.clear()


def _model_and_tokenizer(source: Any, tokenizer: Any) -> tuple[Any, Any]:
    # a transformers model has a `.model` attribute too (its base model), so test for a module first
    if isinstance(source, torch.nn.Module):
        return source, tokenizer
    return source.model, tokenizer if tokenizer is not None else getattr(source, "tokenizer", None)


def calibrate(source: Any, text: str | Sequence[int] | torch.Tensor | None, cfg: S4RConfig, *,
              tokenizer: Any = None, max_tokens: int = CALIBRATION_TOKENS, chunk_size: int = 512,
              register: bool = True) -> Calibration:
    """Run the model over calibration text and decompose every layer's keys and values once.

    `source`: a Session, a LoadedModel or a bare causal LM; `text`: a string (needs the source's or the
    given tokenizer), token ids, or None for `default_calibration_text()`; only its first `max_tokens`
    tokens are used. The model is switched to s4r attention (as a Session does). With `register`,
    methods built later for the same model shape and settings use this calibration.
    """
    model, tokenizer = _model_and_tokenizer(source, tokenizer)
    if text is None:
        text = default_calibration_text()
    if isinstance(text, str):
        if tokenizer is None:
            raise ValueError("calibration text needs a tokenizer (or pass token ids)")
        # a token is a few characters: no need to tokenize a whole book for its first tokens
        ids = tokenizer.encode(text[: 16 * max_tokens], add_special_tokens=False)
    else:
        ids = text.tolist() if isinstance(text, torch.Tensor) else list(text)
    ids = ids[:max_tokens]
    param = next(model.parameters())
    shape = KVShape.from_config(model.config, param.element_size())
    install(model)
    rope = model_rope_fn(model) if cfg.key_space == "pre_rope" else None
    _, width = group_shape(shape, cfg.granularity)
    cache = CompressedCache(shape.layers, shape, query_window=0)
    if len(ids) <= cfg.sinks:
        raise S4RError("the calibration text is too short: it has no tokens past the sinks")
    # no_grad rather than inference_mode: the bases outlive this call and are used outside it
    with torch.no_grad():
        prefill(model, cache, torch.tensor(ids, dtype=torch.long, device=param.device), 0, chunk_size)
        # full width: the ranks are only known per prompt (they depend on its length)
        layers = [fit_layer_bases(*staged_tensors(layer)[:2], cfg, rope, width, width)
                  for layer in cache.layers]
    calibration = Calibration(basis_key(shape, cfg), len(ids), layers)
    if register:
        _REGISTRY[calibration.key] = calibration
    return calibration


@dataclass
class OfflineMethod(S4RMethod):
    """S4R with bases from a calibration instead of the prompt; ranks from the same solver as s4r."""

    config: S4RConfig = field(default_factory=S4RConfig)
    name: str = "offline"
    calibration: Calibration | None = None

    @property
    def layerwise(self) -> bool:
        """Ranks come from the calibration's spectra, so each layer compresses on its own."""
        return True

    def calibrate(self, source: Any, text: str | Sequence[int] | torch.Tensor | None = None, *,
                  tokenizer: Any = None, max_tokens: int = CALIBRATION_TOKENS, chunk_size: int = 512,
                  register: bool = True) -> Calibration:
        """Calibrate on `text` (see the module function `calibrate`) and keep it for `compress`."""
        self.calibration = calibrate(source, text, self.config, tokenizer=tokenizer, max_tokens=max_tokens,
                                     chunk_size=chunk_size, register=register)
        return self.calibration

    def compress(self, cache: CompressedCache, ctx: CompressContext) -> dict:
        cfg = self.config
        calibration = self.calibration or registered_calibration(cache.shape, cfg)
        if calibration is None:
            raise S4RError("the offline method needs calibration first: call its calibrate(session, text)")
        if calibration.key != basis_key(cache.shape, cfg):
            raise S4RError("the offline calibration was made for another model shape or basis settings")
        self.calibration = calibration
        # the same solver as s4r; energy allocation reads the calibration's spectra (the prompt's own
        # are what offline does without)
        ranks = plan_ranks(cache.shape, cfg, cache.logical_length(), calibration.energies)

        def build(i: int, layer):
            keys = layer.keys_view
            rk, rv = ranks[i]
            fitted = calibration.bases(i, rk, rv)
            bases = LayerBases(fitted.k.to(keys.device), fitted.v.to(keys.device))
            return compress_layer(*staged_tensors(layer), cfg, rk, rv, ctx.rope, bases=bases)

        cache.compress(build)
        return {"rank_k": [r[0] for r in ranks], "rank_v": [r[1] for r in ranks],
                "granularity": cfg.granularity, "calibration_tokens": calibration.tokens}
