"""The torch-free checks the library and the CLI share (s4r/validation.py), and that the CLI stays torch-free
until it needs the model."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from s4r import validation
from s4r.errors import ModelLoadError
from s4r.validation import check_device_spec, check_ratio, check_rope_scaling, model_spec_kind

REPO_ROOT = Path(__file__).resolve().parents[1]


class Refused(Exception):
    """The error class a caller hands the checks (the CLI's UsageError, the library's ModelLoadError...)."""


@pytest.mark.parametrize("factor", [0.5, 1.0, 8.5, math.nan, math.inf])
def test_rope_scaling_out_of_range_raises_the_callers_error(factor: float) -> None:
    with pytest.raises(Refused, match="--rope-scaling must be above 1 and at most 8"):
        check_rope_scaling(factor, Refused)


def test_rope_scaling_in_range_passes() -> None:
    assert check_rope_scaling(None, Refused) is None
    assert check_rope_scaling(1.01, Refused) == 1.01
    assert check_rope_scaling(validation.ROPE_SCALING_MAX, Refused) == validation.ROPE_SCALING_MAX


@pytest.mark.parametrize("ratio", [0.99, 0.0, -2.0, math.nan, math.inf])
def test_ratio_below_one_or_not_finite_is_refused(ratio: float) -> None:
    with pytest.raises(Refused, match="--ratio must be at least 1"):
        check_ratio(ratio, Refused, upper=None)


def test_ratio_upper_bound_only_when_asked() -> None:
    assert check_ratio(1.0, Refused) == 1.0
    assert check_ratio(validation.MAX_RATIO, Refused) == validation.MAX_RATIO
    with pytest.raises(Refused, match="absurdly high; use at most 1000"):
        check_ratio(validation.MAX_RATIO + 1, Refused)
    assert check_ratio(5000.0, Refused, upper=None) == 5000.0
    with pytest.raises(Refused, match="^ratios must"):
        check_ratio(0.5, Refused, name="ratios")


@pytest.mark.parametrize("spec", ["auto", "CPU", " cuda ", "cuda:1"])
def test_device_shapes_accepted(spec: str) -> None:
    assert check_device_spec(spec, Refused) == spec.strip().lower()


@pytest.mark.parametrize("spec", ["gpu", "cuda:", "cuda:x", "cpu:0", ""])
def test_device_shapes_refused(spec: str) -> None:
    with pytest.raises(Refused, match="--device must be auto, cpu, cuda or cuda:N"):
        check_device_spec(spec, Refused)


NAMES = ("smollm2-135m", "qwen3-4b")


def test_model_spec_kinds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "folder").mkdir()
    (tmp_path / "smollm2-135m").mkdir()  # a folder named like a profile
    assert model_spec_kind("smollm2-135m", NAMES) == "profile"  # profile names win over same-named folders
    assert model_spec_kind("./smollm2-135m", NAMES) == "local"
    assert model_spec_kind("folder", NAMES) == "local"
    assert model_spec_kind("./nothing-here", NAMES) == "missing"
    assert model_spec_kind("nothing.gguf", NAMES) == "missing"
    assert model_spec_kind("a/b/c", NAMES) == "missing"
    assert model_spec_kind("HuggingFaceTB/SmolLM2-135M-Instruct", NAMES) == "hub"
    assert model_spec_kind("smolm2", NAMES) == "unknown"


def test_loader_dispatches_by_the_same_kinds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from s4r.models.loading import load_model

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelLoadError, match="no such file or folder: ./nothing-here"):
        load_model("./nothing-here", device="cpu")
    with pytest.raises(ModelLoadError, match="unknown model 'smolm2'"):
        load_model("smolm2", device="cpu")


def _python(code: str) -> str:
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                       timeout=120, check=True)
    return p.stdout.strip()


def test_cli_and_shared_checks_import_no_torch() -> None:
    # `s4r --help` and every option error must not pay for importing torch (seconds)
    loaded = _python("import sys, s4r.validation, s4r.units, s4r_cli.app, s4r_cli.bench; "
                     "print('torch' in sys.modules)")
    assert loaded == "False"


def test_a_bad_option_fails_before_torch_is_imported() -> None:
    said = _python("import sys; from s4r_cli.app import run; "
                   "code = run(['ask', 'Q', '--ratio', '0.5', '--file', 'x.txt']); "
                   "print(code, 'torch' in sys.modules)")
    assert said == "2 False"
