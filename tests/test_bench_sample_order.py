"""The accuracy phase runs sample-major (a stopped run keeps every task) and times each sample's parts."""

from __future__ import annotations

import contextlib

import torch

from s4r.bench.report import to_json
from s4r.bench.runner import run_bench
from tests.test_bench import RecordingHooks, tiny_config, tiny_loaded  # noqa: F401 - fixture


class StopAfter(RecordingHooks):
    """Raises KeyboardInterrupt (Ctrl-C) once `count` samples have reported their scores."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.count = count
        self.notes: list[str] = []

    def note(self, message: str) -> None:
        self.notes.append(message)
        if len(self.notes) == self.count:
            raise KeyboardInterrupt


def test_a_stopped_run_has_every_task_with_the_same_samples(tiny_loaded):  # noqa: F811
    torch.set_num_threads(1)
    tasks = ("niah_single_noise", "variable_tracking", "niah_multikey")
    hooks = StopAfter(count=4)  # sample 1 of the three tasks, then sample 2 of the first
    config = tiny_config(methods=("full",), tasks=tasks, samples=3, perplexity=False, speed=False,
                         perplexity_lengths=())
    with contextlib.suppress(KeyboardInterrupt):
        run_bench(tiny_loaded, config, hooks)
    order = [(note.split()[1], note.split()[3].rstrip(":")) for note in hooks.notes]
    assert order == [(tasks[0], "#1"), (tasks[1], "#1"), (tasks[2], "#1"), (tasks[0], "#2")]


def test_accuracy_records_time_the_prefill_and_the_answer(tiny_loaded):  # noqa: F811
    torch.set_num_threads(1)
    config = tiny_config(methods=("full", "streaming"), ratios=(2.0,), tasks=("niah_single_noise",),
                         samples=2, perplexity=False, speed=False, perplexity_lengths=())
    result = run_bench(tiny_loaded, config, RecordingHooks())
    assert len(result.accuracy) == 4
    for record in result.accuracy:
        assert record.prefill_seconds is not None and record.prefill_seconds > 0
        assert record.answer_seconds is not None and record.answer_seconds > 0
    # one prefill per sample, shared by the methods that answered it
    by_sample = {}
    for record in result.accuracy:
        by_sample.setdefault(record.sample, set()).add(record.prefill_seconds)
    assert all(len(seconds) == 1 for seconds in by_sample.values())
    row = to_json(result)["accuracy"]["scores"][0]
    assert row["prefill_seconds"] > 0 and row["answer_seconds"] > 0
