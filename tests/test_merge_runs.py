"""Merging `s4r bench --json` runs split by task: per-task cells, the stratified mean, paired differences."""

from __future__ import annotations

import json

import pytest

from research.merge_runs import load_samples, main, parse_methods, summarize


def run(tmp_path, name: str, task: str, scores: dict[str, list[float]]) -> str:
    samples = [{"task": task, "length": 4096, "sample": i, "method": m, "ratio": 1.0 if m == "full" else 5.0,
                "score": s, "achieved_ratio": 1.0 if m == "full" else 5.4}
               for m, values in scores.items() for i, s in enumerate(values)]
    path = tmp_path / name
    path.write_text(json.dumps({"accuracy": {"samples": samples}}))
    return str(path)


def test_two_runs_split_by_task_make_one_paired_table(tmp_path, capsys):
    a = run(tmp_path, "a.json", "niah_multivalue", {"full": [100, 50, 75, 100], "s4r": [100, 25, 75, 50]})
    b = run(tmp_path, "b.json", "niah_single_book", {"full": [100, 100, 0, 100], "s4r": [100, 100, 0, 0]})
    samples = load_samples([a, b, a])  # a run given twice counts once
    assert len(samples) == 16
    rows = {r["method"]: r for r in summarize(samples)["methods"]}
    full, s4r = rows["full"], rows["s4r"]
    assert full["tasks"]["niah_multivalue"]["score"] == 81.25 and full["mean"]["samples"] == 8
    assert full["mean"]["score"] == pytest.approx((81.25 + 75) / 2, abs=0.01)
    assert s4r["mean"]["score"] == pytest.approx((62.5 + 50) / 2, abs=0.01)
    vs = s4r["vs_full"]
    # paired per sample: differences 0, -25, 0, -50, 0, 0, 0, -100 -> mean -21.875
    assert vs["difference"] == pytest.approx(-21.88, abs=0.01) and vs["samples"] == 8
    assert vs["ci_low"] < vs["difference"] < vs["ci_high"] and vs["ci_high"] > 0  # not clipped at 0
    assert vs["share"] == pytest.approx(56.25 / 78.125, abs=0.001)
    assert vs["task_shares"]["niah_single_book"] == pytest.approx(50 / 75, abs=0.001)
    assert s4r["achieved_ratio"] == 5.4 and "vs_full" not in full
    assert main([a, b, "--json", str(tmp_path / "m.json")]) == 0
    table = capsys.readouterr().out
    assert "| s4r 5 | 5.40x |" in table and "72%" in table
    assert json.loads((tmp_path / "m.json").read_text())["runs"] == [a, b]


def test_a_sample_some_methods_did_not_answer_is_left_out(tmp_path):
    a = run(tmp_path, "a.json", "niah_multivalue", {"full": [100, 50, 0], "s4r": [100, 50]})  # stopped
    rows = {r["method"]: r for r in summarize(load_samples([a]))["methods"]}
    assert rows["full"]["mean"]["samples"] == rows["s4r"]["mean"]["samples"] == 2
    assert rows["s4r"]["vs_full"]["share"] == 1.0


def test_runs_with_different_method_lists_share_a_table_of_the_common_methods(tmp_path):
    a = run(tmp_path, "a.json", "niah_multivalue", {"full": [100, 50], "s4r": [100, 50], "extra": [0, 0]})
    b = run(tmp_path, "b.json", "niah_multikey", {"full": [100, 0], "s4r": [0, 0]})
    assert len(summarize(load_samples([a, b]))["methods"][0]["tasks"]) == 1  # b lacks "extra"
    rows = {r["method"]: r for r in summarize(load_samples([a, b], parse_methods("full,s4r@5")))["methods"]}
    assert set(rows) == {"full", "s4r"} and len(rows["s4r"]["tasks"]) == 2
    assert rows["s4r"]["vs_full"]["difference"] == -25.0


def test_unreadable_or_empty_runs_are_one_line_errors(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main([str(bad)]) == 2
    empty = tmp_path / "empty.json"
    empty.write_text("{}")
    assert main([str(empty)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("error: ") for line in err)
