"""The rounding floor: greedy scores of the full cache, an exact twin that differs only in rounding, and a
compressed cache, on the same samples; how a measuring run ends."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch

from research.progress import ElapsedLog, measuring_parser
from research.rounding_floor import EXACT_TWIN, FloorArm, exact_twin, floor_summary, run_floor
from s4r.bench.decode_speed import SdpaFullLayer
from s4r.runtime.session import Session
from tests.helpers import CharTokenizer
from tests.test_methods import model_for


def _loaded():
    return SimpleNamespace(model=model_for(), tokenizer=CharTokenizer(), name="tiny", device="cpu",
                           dtype=torch.float32, context_length=4096)


def test_the_exact_twin_attends_the_same_tokens_through_sdpa():
    loaded = _loaded()
    staged = Session(loaded, method="full")
    staged.ingest("The grass is green. " * 20, compress=False)
    twin = exact_twin(staged)
    assert all(isinstance(layer, SdpaFullLayer) for layer in twin.cache.layers)
    assert twin.logical_length == staged.logical_length
    assert twin.memory().ratio == 1.0


def test_every_arm_answers_every_sample_and_the_twin_matches_full_in_fp32():
    notes: list[str] = []
    arms = run_floor(_loaded(), task="niah_single_noise", length=768, samples=2, seed=3,
                     book="romeo-and-juliet", methods=[("s4r", 2.0)], max_new_tokens=6, note=notes.append)
    assert list(arms) == ["full", EXACT_TWIN, "s4r@2"]
    for arm in arms.values():
        assert len(arm.scores) == len(arm.answers) == 2
        assert all(0.0 <= s <= 100.0 for s in arm.scores)
    # in fp32 both exact caches run the same SDPA arithmetic: nothing may differ
    assert arms[EXACT_TWIN].answers == arms["full"].answers
    assert len(notes) == 2 and notes[0].startswith("niah_single_noise #1: full ")


def test_the_summary_pairs_every_arm_with_the_full_cache():
    arms = {"full": FloorArm("full", [0.0, 20.0, 0.0, 0.0], ["a", "b", "c", "d"]),
            EXACT_TWIN: FloorArm(EXACT_TWIN, [20.0, 0.0, 0.0, 0.0], ["x", "y", "c", "d"]),
            "s4r@5": FloorArm("s4r@5", [0.0, 20.0, 0.0, 0.0], ["a", "b", "c", "z"])}
    rows = floor_summary(arms)
    assert [r.name for r in rows] == ["full", EXACT_TWIN, "s4r@5"]
    assert rows[0].vs_full.mean == 0.0 and rows[0].changed == 0
    assert rows[1].score.mean == 5.0 and rows[1].vs_full.mean == 0.0 and rows[1].changed == 2
    assert rows[2].vs_full.mean == 0.0 and rows[2].changed == 1


def test_a_measuring_run_ends_with_its_wall_time_and_its_record(tmp_path, capsys):
    log = ElapsedLog()
    log("first sample")
    out = tmp_path / "run.json"
    log.finish(str(out), {"arms": {"full": [1.0, 0.0]}})
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].endswith("] first sample") and printed[-1].startswith("wall ")
    assert json.loads(out.read_text()) == {"arms": {"full": [1.0, 0.0]}}
    log.finish(None, {"not": "written"})  # no path: only the wall line
    assert capsys.readouterr().out.startswith("wall ") and len(list(tmp_path.iterdir())) == 1


def test_measuring_scripts_share_their_common_options():
    parser = measuring_parser("prog", None, length=2048, book="romeo-and-juliet")
    parser.add_argument("--ratio", type=float, default=5.0)
    args = parser.parse_args(["--seed", "7", "--json", "out.json"])
    assert (args.model, args.length, args.seed, args.book, args.json, args.ratio) == (
        "smollm2-135m", 2048, 7, "romeo-and-juliet", "out.json", 5.0)
