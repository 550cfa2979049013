"""The one place s4r calls transformers' ``from_pretrained``: dtype, device map, bitsandbytes, RoPE scaling,
and every failure turned into one readable line."""

from __future__ import annotations

import logging
import warnings
from typing import TYPE_CHECKING, Any

import torch

from s4r.errors import DeviceError, ModelLoadError, S4RError, first_line
from s4r.models.rope_scaling import scale_rope

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["QUANTS", "from_pretrained", "silence_libraries"]

QUANTS = ("none", "8bit", "4bit")


def silence_libraries() -> None:
    """Quiet transformers' and bitsandbytes' logs and progress bars; the CLI shows its own progress."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    # bitsandbytes logs a warning on every 8-bit matmul ("inputs will be cast ... to float16") and about
    # optional CPU kernels; neither is actionable for a user.
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module=r"bitsandbytes(\..*)?")
    warnings.filterwarnings("ignore", message=r".*MatMul8bitLt.*")



def _bnb_config(quant: str, dtype: torch.dtype) -> Any:
    try:
        import bitsandbytes  # noqa: F401  (imported to fail early with a clear message)
        from transformers import BitsAndBytesConfig
    except Exception as exc:
        raise DeviceError(
            f"--quant {quant} needs bitsandbytes, which cannot be loaded here: {first_line(exc)}"
        ) from exc
    if quant == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)



def _tensor_parallel_config(target: str, what: str, ranks: int, local_only: bool) -> Any:
    """The distributed config splitting `target` over `ranks` ranks, once its heads are known to split."""
    from transformers import AutoConfig

    from s4r.distributed.tensor_parallel import check_ranks, distributed_config

    try:
        config = AutoConfig.from_pretrained(target, **({"local_files_only": True} if local_only else {}))
    except Exception as exc:
        raise ModelLoadError(f"cannot load {what}: {first_line(exc)}") from exc
    check_ranks(config, ranks, what)
    return distributed_config(ranks)


def from_pretrained(
    target: str,
    *,
    what: str,
    device: torch.device,
    dtype: torch.dtype,
    quant: str,
    multi_gpu: bool,
    rope_scaling: float | None = None,
    local_only: bool = False,
    tensor_parallel: int = 1,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load model and tokenizer from a folder or hub id, mapping failures to one-line errors.

    ``tensor_parallel`` > 1 (under torchrun): each rank loads its slice of the model's tensor-parallel plan
    (`s4r.distributed.tensor_parallel`); a rank count that does not split the KV heads is refused first.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {"dtype": dtype}
    if local_only:
        kwargs["local_files_only"] = True
    if tensor_parallel > 1:
        # the plan places each rank's slice itself; transformers refuses a device_map beside it
        kwargs["distributed_config"] = _tensor_parallel_config(target, what, tensor_parallel, local_only)
    elif multi_gpu:
        kwargs["device_map"] = "auto"
    elif device.type == "cuda" or quant != "none":
        # Straight onto the target device: no second full copy in host RAM (and bitsandbytes needs a map).
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        kwargs["device_map"] = {"": device}
    if quant != "none":
        kwargs["quantization_config"] = _bnb_config(quant, dtype)
    try:
        tok_kwargs = {"local_files_only": True} if local_only else {}
        tokenizer = AutoTokenizer.from_pretrained(target, **tok_kwargs)
        if rope_scaling is not None:
            kwargs["config"] = AutoConfig.from_pretrained(target, **tok_kwargs)
            scale_rope(kwargs["config"], rope_scaling)
        model = AutoModelForCausalLM.from_pretrained(target, **kwargs)
    except S4RError:
        raise
    except (MemoryError, torch.OutOfMemoryError) as exc:
        raise DeviceError(f"not enough memory to load {what} on {device}") from exc
    except Exception as exc:
        if quant != "none" and "bitsandbytes" in f"{type(exc).__module__} {exc}".lower():
            raise DeviceError(f"--quant {quant} is not available here: {first_line(exc)}") from exc
        raise ModelLoadError(f"cannot load {what}: {first_line(exc)}") from exc
    return model, tokenizer
