"""`s4r bench`: the runner on a tiny random model (fast), option checks, and the real quick run (slow)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from s4r.bench.config import DEFAULT_METHODS, QUICK_METHODS, QUICK_TASKS, BenchConfig, parse_lengths
from s4r.bench.records import BenchHooks
from s4r.bench.report import to_json, write_json
from s4r.bench.report_tables import tables
from s4r.bench.runner import BenchRunner, run_bench
from s4r.bench.speed import check_lengths_fit, param_count, plan_memory, teacher_force
from s4r.core.budget import KVShape
from s4r.errors import DeviceError
from s4r.runtime.session import Session
from tests.helpers import _BASE, CharTokenizer, tiny_model

REPO_ROOT = Path(__file__).resolve().parents[1]
RATIOS = (2.0, 4.0)


class RecordingHooks(BenchHooks):
    """Keeps what a run reported."""

    def __init__(self) -> None:
        self.phases: list[tuple[str, int]] = []
        self.done: dict[str, int] = {}
        self.warnings: list[str] = []
        self._current = ""

    def phase(self, name: str, total: int) -> None:
        self.phases.append((name, total))
        self._current = name
        self.done[name] = 0

    def advance(self, detail: str = "", units: int = 1) -> None:
        self.done[self._current] = self.done.get(self._current, 0) + units

    def warn(self, message: str) -> None:
        self.warnings.append(message)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from threads, and on a shared machine extra threads only wait on each other
    (tens of times slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_loaded() -> SimpleNamespace:
    return SimpleNamespace(model=tiny_model("llama"), tokenizer=CharTokenizer(), name="tiny", device="cpu",
                           dtype=torch.float32, context_length=4096, source="test")


def tiny_config(**changes) -> BenchConfig:
    # characters are tokens here: 768-token contexts take a fraction of a second on the tiny model
    base = BenchConfig.quick_preset(methods=DEFAULT_METHODS, lengths=(768,), perplexity_lengths=(768,),
                                    ratios=RATIOS, tasks=("niah_single_noise", "variable_tracking"),
                                    max_new_tokens=4, continuation_tokens=12, decode_steps=6, warmup_steps=2)
    return BenchConfig(**{**base.__dict__, **changes})


@pytest.fixture(scope="module")
def tiny_run(tiny_loaded) -> tuple:
    hooks = RecordingHooks()
    result = run_bench(tiny_loaded, tiny_config(), hooks)
    return result, hooks


def test_runner_covers_every_method_task_and_ratio(tiny_run):
    result, hooks = tiny_run
    assert result.methods == list(DEFAULT_METHODS)
    assert not result.issues, result.issues
    seen = {(r.task, r.method, r.ratio) for r in result.accuracy}
    for task in ("niah_single_noise", "variable_tracking"):
        assert (task, "full", 1.0) in seen
        for method in DEFAULT_METHODS[1:]:
            for ratio in RATIOS:
                assert (task, method, ratio) in seen
    for r in result.accuracy:
        assert 0.0 <= r.score <= 100.0
        if r.method != "full":
            assert r.achieved_ratio >= r.ratio, (r.method, r.ratio, r.achieved_ratio)
            assert r.stored_bytes < r.full_bytes
    # every phase was announced and completed exactly
    for name, total in hooks.phases:
        assert hooks.done[name] == total, name


def test_context_phase_measures_speed_memory_and_perplexity(tiny_run):
    result, _ = tiny_run
    combos = {(c.method, c.ratio) for c in result.contexts}
    assert ("full", 1.0) in combos and len(combos) == 1 + (len(DEFAULT_METHODS) - 1) * len(RATIOS)
    assert result.contexts[0].method == "full"
    for c in result.contexts:
        assert c.prefill_seconds > 0 and c.compress_seconds >= 0
        assert c.decode is not None and c.decode.steps == 12 + 1 - 2  # continuation + 1 fed, 2 warm-up
        assert c.decode.tok_s > 0
        assert c.nll is not None and math.isfinite(c.nll) and c.scored_tokens == 12
        assert c.achieved_ratio >= (1.0 if c.method == "full" else c.ratio)
    (info,) = result.lengths
    assert info.perplexity and info.speed and info.peak_rss_bytes > 0
    assert [c["method"] for c in result.calibrations] == ["offline"]


def test_json_document_is_complete_and_strict(tiny_run, tmp_path):
    result, _ = tiny_run
    doc = to_json(result, "s4r bench --test")
    # strict JSON: no NaN or infinities anywhere
    text = json.dumps(doc, allow_nan=False)
    assert json.loads(text)["schema"] == "s4r-bench/1"
    run = doc["run"]
    for key in ("command", "date", "machine", "versions", "model", "device", "dtype"):
        assert run[key] is not None, key
    assert set(run["versions"]) >= {"torch", "transformers"}
    assert {s["method"] for s in doc["accuracy"]["scores"]} == set(DEFAULT_METHODS)
    # every accuracy figure carries its sample count and its 95% interval (null where one sample)
    for row in doc["accuracy"]["scores"] + doc["accuracy"]["summary"] + doc["accuracy"]["overall"]:
        assert {"score", "ci_low", "ci_high", "samples"} <= set(row) and row["samples"] >= 1
        if row["ci_low"] is not None:
            assert row["ci_low"] <= row["score"] <= row["ci_high"]
    full_ppl = [p for p in doc["perplexity"] if p["method"] == "full"]
    assert full_ppl and full_ppl[0]["nll_gap"] == 0.0
    for s in doc["speed"]:
        assert s["decode_tok_s"] > 0 and s["decode_vs_full"] > 0
        assert s["ingest_seconds"] >= s["prefill_seconds"] > 0
    assert {c["ratio"] for c in doc["compression"]} == set(RATIOS)
    assert all(k["stored_mib"] > 0 for k in doc["memory"]["kv"])
    titles = [t.title for t in tables(doc)]
    assert titles[0].startswith("Accuracy by task") and any(t.startswith("Context") for t in titles)
    path = tmp_path / "sub" / "out.json"
    write_json(doc, path)
    assert json.loads(path.read_text())["methods"] == list(DEFAULT_METHODS)


def test_plot_writes_a_png(tiny_run, tmp_path):
    pytest.importorskip("matplotlib")
    from s4r.bench.report_plot import plot

    path = tmp_path / "bench.png"
    plot(to_json(tiny_run[0]), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unknown_method_is_skipped_and_failures_are_recorded(tiny_loaded, monkeypatch):
    original = BenchRunner._fork

    def broken(self, staged, method, ratio):
        if method == "snapkv":
            raise RuntimeError("boom")
        return original(self, staged, method, ratio)

    monkeypatch.setattr(BenchRunner, "_fork", broken)
    hooks = RecordingHooks()
    cfg = tiny_config(methods=("s4r", "no-such-method", "snapkv"), ratios=(2.0,),
                      tasks=("niah_single_noise",), perplexity=False)
    result = run_bench(tiny_loaded, cfg, hooks)
    assert result.methods == ["full", "s4r", "snapkv"]
    kinds = {(i.kind, i.method) for i in result.issues}
    assert ("skipped", "no-such-method") in kinds and ("error", "snapkv") in kinds
    assert any("no-such-method" in w for w in hooks.warnings)
    # the failure is recorded once per phase with a count, and the other methods still ran
    acc = [i for i in result.errors() if i.phase == "accuracy"]
    assert len(acc) == 1 and "boom" in acc[0].message
    assert {r.method for r in result.accuracy} == {"full", "s4r"}
    assert {c.method for c in result.contexts} == {"full", "s4r"}


def test_modes_select_phases(tiny_loaded):
    speed = run_bench(tiny_loaded, tiny_config(accuracy=False, perplexity=False, methods=("s4r",)))
    assert not speed.accuracy and speed.contexts and all(c.nll is None for c in speed.contexts)
    acc = run_bench(tiny_loaded, tiny_config(perplexity=False, speed=False, methods=("streaming",)))
    assert acc.accuracy and not acc.contexts
    doc = to_json(acc)
    # accuracy-only runs still report the stored bytes of each method
    assert {k["method"] for k in doc["memory"]["kv"]} == {"full", "streaming"}


def test_method_ratios_and_the_book_reach_the_runner(tiny_loaded):
    cfg = tiny_config(perplexity=False, speed=False, methods=("s4r", "quant"), samples=2,
                      tasks=("niah_single_book",), method_ratios={"quant": (2.0,)}, book="romeo-and-juliet")
    result = run_bench(tiny_loaded, cfg)
    assert {(r.method, r.ratio) for r in result.accuracy} == {("full", 1.0), ("quant", 2.0)} | {
        ("s4r", r) for r in RATIOS}
    assert all(r.max_new_tokens is not None and r.max_new_tokens <= 4 for r in result.accuracy)
    doc = to_json(result)
    (row,) = [s for s in doc["accuracy"]["overall"] if s["method"] == "quant"]
    assert row["samples"] == 2 and row["ci_low"] is not None
    assert doc["config"]["book"] == "romeo-and-juliet"


def test_random_weights_measure_speed_only(tiny_loaded):
    hooks = RecordingHooks()
    result = BenchRunner(tiny_loaded, tiny_config(methods=("s4r",)), hooks, random_weights=True).run()
    assert not result.accuracy and result.contexts
    assert any("random weights" in w for w in hooks.warnings)


def test_lengths_longer_than_the_context_are_clamped(tiny_loaded):
    small = SimpleNamespace(**{**tiny_loaded.__dict__, "context_length": 1400})
    hooks = RecordingHooks()
    runner = BenchRunner(small, tiny_config(), hooks)
    fitted = runner.fit_length(4096)
    assert fitted < 1400 - 512 and any("do not fit" in w for w in hooks.warnings)
    assert runner.fit_length(512) == 512


def test_teacher_force_interleaves_every_session(tiny_loaded):
    sessions = []
    for method in ("full", "streaming"):
        s = Session(tiny_loaded, method=method, ratio=2.0)
        s.ingest("All happy families are alike. " * 20)
        sessions.append(s)
    seen: list[tuple[int, int]] = []
    timings = teacher_force(sessions, [5, 6, 7, 8], warmup=1, on_logits=lambda j, i, _: seen.append((j, i)))
    assert sorted(seen) == [(j, i) for j in range(2) for i in range(4)]
    # the order rotates: session 1 goes first at odd steps
    assert seen[2] == (1, 1)
    assert [t.steps for t in timings] == [3, 3] and all(t.tok_s > 0 for t in timings)


def test_param_count_matches_a_built_model():
    model = tiny_model("llama")
    assert param_count(_BASE) == sum(p.numel() for p in model.parameters())


def test_memory_check_refuses_what_cannot_fit():
    shape = KVShape(layers=32, kv_heads=8, q_heads=32, head_dim=128, dtype_bytes=2)  # Llama 3.1 8B, bf16
    plan = plan_memory(shape, 131072, [2.5, 5.0], device=torch.device("cpu"))
    assert plan.kv > 3 * shape.full_bytes(131072)
    with pytest.raises(DeviceError, match="131,072"):
        check_lengths_fit(shape, [32768, 131072], [5.0], device=torch.device("cpu"), weights=16 * 2**30,
                          free=64 * 2**30)
    check_lengths_fit(shape, [1024], [5.0], device=torch.device("cpu"), free=64 * 2**30)


def test_parse_lengths():
    assert parse_lengths(["2k", "4K", "8192", " 128k "]) == (2048, 4096, 8192, 131072)
    with pytest.raises(ValueError):
        parse_lengths(["2x"])
    with pytest.raises(ValueError):
        parse_lengths(["1.5"])


# --- CLI option checks (fail before any model is loaded) ---------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--speed-only", "--accuracy-only"], "exclude each other"),
    (["--methods", "s4r,nosuch"], "unknown method"),
    (["--ratios", "0.5"], "ratio must be at least 1"),
    (["--lengths", "2x"], "--lengths"),
    (["--tasks", "niah_nope"], "unknown task"),
    (["--random-weights", "--model", "some/hub-id"], "profile name"),
    (["--random-weights", "--accuracy-only"], "speed and memory only"),
    (["--plot", "out.txt"], "--plot"),
])
def test_bad_options_are_usage_errors(argv, message, capsys):
    from s4r_cli.app import run

    assert run(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


def test_random_weights_on_cpu_refuse_lengths_that_cannot_fit(monkeypatch, capsys):
    from s4r_cli.app import run

    # as if the machine had 8 GiB free: an 8B model alone needs 16 GiB in bf16
    monkeypatch.setattr("s4r.bench.speed.available_bytes", lambda device: 8 * 2**30)
    code = run(["bench", "--random-weights", "--model", "llama-3.1-8b-instruct", "--device", "cpu",
                "--lengths", "32k"])
    assert code == 1
    err = capsys.readouterr().err
    assert "cannot fit in memory" in err and "--device cuda" in err


# --- the real thing ----------------------------------------------------------------------------------------

@pytest.mark.slow
def test_quick_bench_end_to_end(tmp_path):
    out = tmp_path / "out.json"
    plot = tmp_path / "out.png"
    # One ratio: every method still runs end to end on the real model, in about half the time of both
    # ratios (the slowest test of the suite); both ratios run on a tiny model in the runner tests above.
    proc = subprocess.run([sys.executable, "-m", "s4r_cli", "bench", "--quick", "--ratios", "5", "--json",
                           str(out), "--plot", str(plot)], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Accuracy by task" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["run"]["model"] == "smollm2-135m" and doc["config"]["quick"]
    assert doc["methods"] == list(QUICK_METHODS)
    assert not [i for i in doc["issues"] if i["kind"] == "error"], doc["issues"]
    ratios = doc["config"]["ratios"]
    assert ratios == [5.0]
    scores = {(s["task"], s["method"], s["ratio"]): s["score"] for s in doc["accuracy"]["scores"]}
    for task in QUICK_TASKS:
        assert (task, "full", 1.0) in scores
        for method in QUICK_METHODS[1:]:
            for ratio in ratios:
                assert (task, method, ratio) in scores, (task, method, ratio)
    assert all(0.0 <= v <= 100.0 for v in scores.values())
    for sample in doc["accuracy"]["samples"]:
        assert sample["achieved_ratio"] >= sample["ratio"], sample
    for kv in doc["memory"]["kv"]:
        assert kv["achieved_ratio"] >= kv["ratio"] and kv["stored_bytes"] > 0, kv
    speed = {(s["method"], s["ratio"]) for s in doc["speed"]}
    assert speed == {("full", 1.0)} | {(m, r) for m in QUICK_METHODS[1:] for r in ratios}
    for s in doc["speed"]:
        assert s["prefill_seconds"] > 0 and s["decode_tok_s"] > 0
        assert s["ingest_seconds"] >= s["prefill_seconds"]
    assert all(p["nll"] is not None and p["nll"] > 0 for p in doc["perplexity"])
    assert doc["memory"]["peak_rss_bytes"] > 0
    assert plot.stat().st_size > 0
