"""Random-weight models of a profile's shape (``--random-weights``): speed and memory runs, no download."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch

from s4r.errors import DeviceError, ModelLoadError, first_line
from s4r.models.embedded_model import embedded_model_dir
from s4r.models.load_progress import Progress, report
from s4r.models.model_store import models_dir
from s4r.models.profiles import DEFAULT_PROFILE, Profile
from s4r.models.random_quant import quantize_linears
from s4r.models.rope_scaling import scale_rope

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["build_config", "build_random"]


def _random_tokenizer(profile: Profile, progress: Progress | None) -> PreTrainedTokenizerBase:
    """The profile's own tokenizer if it is in the local HF cache, else the embedded SmolLM2 one (its
    tokenizer files alone will do: a random model needs no converted weights)."""
    from transformers import AutoTokenizer

    if profile.source == "hub" and profile.hf_id:
        with contextlib.suppress(Exception):
            return AutoTokenizer.from_pretrained(profile.hf_id, local_files_only=True)
    embedded = models_dir() / DEFAULT_PROFILE
    if (embedded / "tokenizer.json").is_file():
        with contextlib.suppress(Exception):
            return AutoTokenizer.from_pretrained(str(embedded), local_files_only=True)
    return AutoTokenizer.from_pretrained(str(embedded_model_dir(progress=progress)))


def build_config(architecture: dict[str, Any]) -> Any:
    """A transformers config of the shape described by a profile's ``architecture`` table."""
    from transformers import AutoConfig

    arch = dict(architecture)
    model_type = arch.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **arch)
    except Exception as exc:
        raise ModelLoadError(f"cannot build a '{model_type}' config: {first_line(exc)}") from exc


def build_random(
    profile: Profile,
    device: torch.device,
    dtype: torch.dtype,
    progress: Progress | None,
    rope_scaling: float | None = None,
    quant: str = "none",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A model of the profile's shape with seeded random weights, and a tokenizer to drive it; with `quant`
    "8bit"/"4bit" its linear layers are bitsandbytes ones, as `--quant` loads a checkpoint."""
    from transformers import AutoModelForCausalLM

    tokenizer = _random_tokenizer(profile, progress)
    config = build_config(profile.architecture)
    if rope_scaling is not None:
        scale_rope(config, rope_scaling)
    report(progress, "load", 0.2)
    torch.manual_seed(0)
    try:
        # Initialising on the target device is much faster for GPU-sized shapes than init-then-copy.
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        if quant != "none":
            quantize_linears(model, quant, dtype, device)
    except (MemoryError, torch.OutOfMemoryError) as exc:
        raise DeviceError(f"not enough memory for a random-weight {profile.name} on {device}") from exc
    vocab = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > vocab:
        # The fallback tokenizer can produce ids past a small-vocab profile (SmolLM2 49152 > Mistral 32768);
        # clamp them rather than change the benchmarked shape. The output is noise either way.
        limit = vocab - 1

        def clamp(_module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            return (args[0].clamp(max=limit), *args[1:])

        model.get_input_embeddings().register_forward_pre_hook(clamp)
    return model, tokenizer

