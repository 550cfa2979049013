"""GGUF files: dequantized once with transformers and cached as a plain safetensors folder.

A user's ``.gguf`` is converted on first use into ``$S4R_HOME/models/gguf-<name>-<fingerprint>`` (the
embedded default model arrives as a GGUF too: :mod:`s4r.models.embedded_model`); later loads read the folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from s4r.errors import DeviceError, ModelLoadError, S4RError, first_line
from s4r.models.load_progress import Progress, report
from s4r.models.model_store import (
    CACHE_FORMAT,
    MARKER,
    cache_ok,
    clean_stale,
    install_folder,
    models_dir,
    tmp_name,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["CHATML_TEMPLATE", "convert_gguf", "convert_into_cache", "converted_gguf_dir",
           "ensure_chat_template"]

# GGUF files bigger than this are dequantized to bf16 instead of fp32: a 7B model in fp32 would need ~28 GB of
# RAM and disk, and bf16 rounding is far below the 4-8 bit quantization error already in the weights.
GGUF_FP32_MAX_BYTES = 2 * 1024**3

# Plain ChatML, used only when a tokenizer with ChatML special tokens arrives without any template.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@contextlib.contextmanager
def _gguf_tensor_progress(progress: Progress | None, lo: float, hi: float) -> Iterator[None]:
    """Replace the tqdm bar transformers draws while dequantizing GGUF tensors with ``convert`` reports."""
    # transformers' legacy GGUF loader calls a bare tqdm that disable_progress_bar() does not reach; swapping
    # the module's name both silences it and gives us a real fraction for the slowest step.
    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # pragma: no cover - layout of a different transformers version
        yield
        return
    original = getattr(gguf_utils, "tqdm", None)
    if original is None:  # pragma: no cover
        yield
        return

    def quiet(iterable: Any = None, *args: Any, **kwargs: Any) -> Iterator[Any]:
        total = kwargs.get("total") or (len(iterable) if hasattr(iterable, "__len__") else 0)
        step = max(1, total // 20)
        for i, item in enumerate(iterable):
            if total and i % step == 0:
                report(progress, "convert", lo + (hi - lo) * i / total)
            yield item

    gguf_utils.tqdm = quiet
    try:
        yield
    finally:
        gguf_utils.tqdm = original



def _strip_gguf_quantizer(model: PreTrainedModel) -> None:
    """Make a dequantized GGUF model savable: transformers still marks it as "quantized with gguf"."""
    # Even when every weight was unpacked to a dense tensor, from_pretrained leaves the GGUF quantizer
    # attached and save_pretrained refuses to serialize it. The weights are plain nn.Linear by now.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    for attr in ("is_quantized", "quantization_method"):
        if attr in vars(model):
            delattr(model, attr)


def ensure_chat_template(tokenizer: PreTrainedTokenizerBase) -> None:
    """Give a ChatML tokenizer that lost its template (some GGUF exports drop it) the plain ChatML one."""
    if getattr(tokenizer, "chat_template", None):
        return
    if "<|im_start|>" in tokenizer.get_vocab():
        tokenizer.chat_template = CHATML_TEMPLATE


def convert_gguf(
    gguf: Path,
    out: Path,
    *,
    key: str,
    extra: dict[str, Any],
    context_length: int | None,
    progress: Progress | None,
) -> None:
    """Dequantize ``gguf`` with transformers and save model + tokenizer as a safetensors folder at ``out``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        with gguf.open("rb") as fh:
            magic = fh.read(4)
    except OSError as exc:
        raise ModelLoadError(f"cannot read {gguf}: {exc.strerror or exc}") from exc
    if magic != b"GGUF":
        raise ModelLoadError(f"{gguf} is not a GGUF file (bad header); the file may be corrupt or incomplete")
    # fp32 keeps the dequantized values exactly (a Q4/Q8 block value fits in fp32's mantissa, not bf16's).
    dtype = torch.float32 if gguf.stat().st_size <= GGUF_FP32_MAX_BYTES else torch.bfloat16
    report(progress, "convert", 0.0)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        report(progress, "convert", 0.15)
        with _gguf_tensor_progress(progress, 0.2, 0.85):
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=dtype)
    except S4RError:
        raise
    except (MemoryError, torch.OutOfMemoryError) as exc:
        raise DeviceError(f"not enough memory to convert {gguf.name}") from exc
    except Exception as exc:
        raise ModelLoadError(f"cannot load GGUF file {gguf}: {first_line(exc)}") from exc
    _strip_gguf_quantizer(model)
    ensure_chat_template(tokenizer)
    tokenizer.model_max_length = context_length or model.config.max_position_embeddings
    report(progress, "convert", 0.9)
    out.mkdir(parents=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    marker = {"format": CACHE_FORMAT, "key": key, "dtype": str(dtype).removeprefix("torch."), **extra}
    # Written last: its presence is what marks the folder complete.
    (out / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    report(progress, "convert", 1.0)


def convert_into_cache(
    gguf: Path,
    final: Path,
    *,
    key: str,
    extra: dict[str, Any],
    context_length: int | None,
    progress: Progress | None,
) -> None:
    """Convert ``gguf`` into a temp folder next to ``final``, then move it into place atomically."""
    tmp = tmp_name(final.parent, final.name)
    try:
        convert_gguf(gguf, tmp, key=key, extra=extra, context_length=context_length, progress=progress)
        install_folder(tmp, final, key)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)



def _gguf_fingerprint(path: Path) -> str:
    """A sha256 of the file's size and its first and last 8 MiB: cheap for multi-GB files, yet specific."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    chunk = 8 << 20
    with path.open("rb") as fh:
        digest.update(fh.read(chunk))
        if size > chunk:
            fh.seek(max(chunk, size - chunk))
            digest.update(fh.read(chunk))
    return digest.hexdigest()


def converted_gguf_dir(path: Path, progress: Progress | None) -> Path:
    """The cached converted copy of a user's ``.gguf`` file, converting it on first use."""
    try:
        key = _gguf_fingerprint(path)
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc.strerror or exc}") from exc
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", path.stem)[:48].strip(".-") or "model"
    final = models_dir() / f"gguf-{stem}-{key[:12]}"
    if cache_ok(final, key):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(final.parent)
    extra = {"source": str(path)}
    convert_into_cache(path, final, key=key, extra=extra, context_length=None, progress=progress)
    return final

