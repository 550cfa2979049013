"""Tensor parallelism on loopback CPU ranks (gloo), launched as torchrun launches: a tiny llama with 4 KV
heads split over 2 and 4 ranks answers as one process does, each rank stores its share of the cache, a
cache saved by 2 ranks loads with 2 and is refused elsewhere, and bad setups end in one line on rank 0."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from tests.ranks_fixtures import await_output, launch, start_ranks, tiny_model_dir, wait_ranks

QUESTION = "What is the key?"


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny model's folder and a document long enough for ratio 2."""
    root = tmp_path_factory.mktemp("ranks")
    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "ember"]
    text = " ".join(words[(i * 7 + i // 3) % len(words)] for i in range(300))
    doc = root / "doc.txt"
    doc.write_text(text[:800] + " The key is 4821. " + text[800:])
    return {"model": tiny_model_dir(root / "tiny"), "doc": doc, "root": root}


def model_argv(setup: dict[str, Path]) -> list[str]:
    return ["--model", str(setup["model"]), "--threads", "1", "--dtype", "fp32"]


def ask_argv(setup: dict[str, Path], *extra: str) -> list[str]:
    return ["ask", QUESTION, *model_argv(setup), "--json", "-n", "8", *extra]


def record(results) -> dict:
    """Rank 0's --json record; the other ranks printed nothing and ended cleanly."""
    assert results[0].code == 0, results[0].err
    for other in results[1:]:
        assert other.code == 0 and other.out == "" and other.err == "", other.err
    return json.loads(results[0].out)


def one_error_line(results) -> str:
    """Rank 0 ended non-zero with exactly one error line; every other rank non-zero and silent."""
    assert results[0].code != 0
    lines = [line for line in results[0].err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("s4r: error: "), results[0].err
    for other in results[1:]:
        assert other.code != 0 and other.out == "" and other.err == ""
    return lines[0]


def test_two_ranks_answer_as_one_process_and_split_the_cache(setup):
    one = record(launch(1, ask_argv(setup, "--file", str(setup["doc"]), "--method", "full")))
    two = record(launch(2, ask_argv(setup, "--file", str(setup["doc"]), "--method", "full")))
    assert "ranks" not in one
    assert two["answer"] == one["answer"] and two["generated_tokens"] == one["generated_tokens"] > 0
    # each rank keeps 2 of the 4 KV heads: half the uncompressed cache each, the whole in all
    assert two["kv_bytes_per_rank"] == [one["kv_bytes"] // 2] * 2
    assert two["kv_bytes"] == one["kv_bytes"] and two["kv_full_bytes"] == one["kv_full_bytes"]


def test_four_ranks_compress_one_kv_head_each(setup):
    four = record(launch(4, ask_argv(setup, "--file", str(setup["doc"]), "--ratio", "2")))
    assert four["ranks"] == 4 and four["compressed"] and four["generated_tokens"] > 0
    stored, full = four["kv_bytes_per_rank"], four["kv_full_bytes_per_rank"]
    assert full == [full[0]] * 4 and sum(full) == four["kv_full_bytes"]
    for rank_stored, rank_full in zip(stored, full, strict=True):
        assert rank_full / rank_stored >= 2.0  # the ratio holds on every rank
    assert max(stored) - min(stored) <= 0.05 * max(stored)  # about a quarter each


def chat_argv(setup: dict[str, Path], *extra: str) -> list[str]:
    return ["chat", *model_argv(setup), "--file", str(setup["doc"]), "--ratio", "2", *extra]


def test_saved_by_two_ranks_loads_with_two_and_is_refused_elsewhere(setup):
    saved = setup["root"] / "two.s4r"
    # chat saves the cache of the document alone, then answers the question over it
    chat = launch(2, chat_argv(setup, "-n", "8"), stdin=f"/save {saved}\n{QUESTION}\n/exit\n")
    assert [r.code for r in chat] == [0, 0], chat[0].err
    fresh = chat[0].out.strip()
    assert fresh
    parts = sorted(p.name for p in saved.parent.glob("two.s4r*"))
    assert parts == ["two.s4r.rank0-of-2", "two.s4r.rank1-of-2"]  # one file per rank
    loaded = record(launch(2, ask_argv(setup, "--load", str(saved))))
    assert loaded["answer"].strip() == fresh
    stored = loaded["kv_bytes_per_rank"]
    assert len(stored) == 2 and sum(stored) == loaded["kv_bytes"]
    assert abs(stored[0] - stored[1]) <= 0.05 * stored[0]  # each rank loaded its own half
    line = one_error_line(launch(1, ask_argv(setup, "--load", str(saved))))
    assert "saved by 2 ranks" in line and "this run has one process" in line


def test_ranks_that_do_not_divide_the_kv_heads_end_in_one_line(setup):
    line = one_error_line(launch(3, ask_argv(setup, "--file", str(setup["doc"]))))
    assert "3 ranks do not divide the 4 KV heads" in line and "1, 2, 4 ranks" in line


def ends_in_one_error_line(procs) -> None:
    """Rank 1 dies once rank 0's answer has begun: rank 0 ends non-zero, its one error line last."""
    await_output(procs[0])
    os.killpg(procs[1].pid, signal.SIGKILL)
    results = wait_ranks(procs)
    assert results[0].code != 0
    lines = [line for line in results[0].err.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line]
    assert errors == [lines[-1]] and lines[-1].startswith("s4r: error: another rank stopped"), results[0].err


def test_a_dead_rank_ends_rank_0_in_one_line(setup):
    # answers that run to the context limit (a minute and more here), so rank 1 dies in the middle of them
    long = ("-n", "4000", "--no-loop-guard")
    ends_in_one_error_line(start_ranks(2, ["ask", QUESTION, *model_argv(setup), "--file", str(setup["doc"]),
                                           "--ratio", "2", *long]))
    ends_in_one_error_line(start_ranks(2, chat_argv(setup, *long), stdin=f"{QUESTION}\n{QUESTION}\n"))
