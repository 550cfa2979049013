"""The decode-speed table: its rows, and a plain transformers reference that computes what full does."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from s4r.bench.decode_speed import (
    PLAIN,
    SDPA_FULL,
    make_forks,
    markdown,
    measure,
    method_spec,
    staged_cache,
    tiled,
)
from s4r.core.rope import model_rope_fn
from s4r.hf.generation import forward_tokens
from tests.helpers import CharTokenizer, tiny_model


def tiny_loaded() -> SimpleNamespace:
    return SimpleNamespace(model=tiny_model("llama"), tokenizer=CharTokenizer(), device="cpu")


def test_every_fork_decodes_and_the_exact_ones_agree(monkeypatch):
    import transformers.integrations.sdpa_attention as sdpa

    calls = []
    real = sdpa.sdpa_attention_forward
    monkeypatch.setattr(sdpa, "sdpa_attention_forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    loaded = tiny_loaded()
    ids = torch.randint(0, 100, (920,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.inference_mode():
        staged = staged_cache(loaded.model, ids[:900], chunk_size=128)
        forks = make_forks(loaded.model, staged, [("s4r", 2.5)])
        assert [f.name for f in forks] == ["full", "s4r 2.5", SDPA_FULL, PLAIN]
        logits = {f.name: [] for f in forks}
        for pos, token in enumerate(ids[900:], start=900):
            for fork in forks:
                step = forward_tokens(loaded.model, fork.cache, torch.tensor([[token]]), pos)
                logits[fork.name].append(step)
    # plain transformers (DynamicCache + sdpa) and the folded full cache are the same exact attention
    for reference in (PLAIN, SDPA_FULL):
        torch.testing.assert_close(torch.stack(logits[reference]), torch.stack(logits["full"]), atol=1e-4,
                                   rtol=1e-4)
    assert forks[1].cache.ratio() > 2.2
    # only the reference row ran transformers' own attention: once per layer and step
    assert len(calls) == 20 * loaded.model.config.num_hidden_layers


def test_a_method_spec_carries_its_settings_into_the_fork():
    assert method_spec("s4r") == ("s4r", {})
    assert method_spec("s4r+recon_token_cap=64+recon_drop=None+scoring=max") == (
        "s4r", {"recon_token_cap": 64, "recon_drop": None, "scoring": "max"})
    loaded = tiny_loaded()
    with torch.inference_mode():
        staged = staged_cache(loaded.model, list(range(5, 95)) * 10, chunk_size=128)
        forks = make_forks(loaded.model, staged, [("s4r+recon_token_cap=64", 2.5)])
    assert forks[1].name == "s4r+recon_token_cap=64 2.5"
    assert all(layer.cfg.recon_token_cap == 64 for layer in forks[1].cache.layers)


def test_measure_gives_one_row_per_fork_relative_to_full(monkeypatch):
    monkeypatch.setattr("s4r.bench.decode_speed.book_ids",
                        lambda tok, n, book=None: [i % 90 + 5 for i in range(n)])
    rows = measure(tiny_loaded(), [900], [("s4r", 2.5)], steps=3, warmup=1, log=lambda m: None)
    assert [(r.method, r.steps) for r in rows] == [("full", 3), ("s4r 2.5", 3), (SDPA_FULL, 3), (PLAIN, 3),
                                                   ("floor: weights float32", 3)]
    assert rows[0].vs_full == 1.0 and all(r.median_ms > 0 for r in rows)
    assert all(r.nll is not None and r.nll > 0 for r in rows[:4]) and rows[-1].weight_gb_s > 0
    assert "| 900 | s4r 2.5 |" in markdown(rows)


def test_measure_forks_every_cache_per_decode_step(monkeypatch):
    monkeypatch.setattr("s4r.bench.decode_speed.book_ids",
                        lambda tok, n, book=None: [i % 90 + 5 for i in range(n)])
    rows = measure(tiny_loaded(), [900], [("s4r", 2.5)], steps=3, warmup=1, log=lambda m: None,
                   decode_steps=("lean-eager", "reference"), reference_rows=False, floor=False)
    assert [r.method for r in rows] == ["full [lean-eager]", "full [reference]", "s4r 2.5 [lean-eager]",
                                        "s4r 2.5 [reference]"]
    # the two steps decode the same tokens to the same predictions (fp32 matrices on a tiny model)
    assert rows[0].nll == pytest.approx(rows[1].nll, abs=1e-4)
    assert rows[2].nll == pytest.approx(rows[3].nll, abs=1e-4)


def test_lengths_past_the_prefill_tile_it(monkeypatch):
    monkeypatch.setattr("s4r.bench.decode_speed.book_ids",
                        lambda tok, n, book=None: [i % 90 + 5 for i in range(n)])
    with torch.inference_mode():
        staged = staged_cache(tiny_model("llama"), [i % 90 + 5 for i in range(900)], chunk_size=128)
    long = tiled(staged, 2000)
    keys, base = long.layers[1].keys_view, staged.layers[1].keys_view
    assert long.logical_length() == 2000 and keys.shape[2] == 2000
    torch.testing.assert_close(keys[:, :, 1800:], base[:, :, :200])
    seen = []
    rows = measure(tiny_loaded(), [900, 2000], [("s4r", 2.5)], steps=2, warmup=1, log=seen.append,
                   prefill_tokens=900)
    assert [r.length for r in rows] == [900] * 5 + [2000] * 5
    assert "2000 tokens: 900 prefilled and tiled" in seen[-6]


def test_layer_speed_times_every_kernel_on_one_layer():
    from s4r.bench.layer_speed import layer_times
    from s4r.core.budget import KVShape

    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(3, 900, 16, generator=g), torch.randn(3, 900, 16, generator=g)
    queries = torch.randn(9, 32, 16, generator=g)
    rope = model_rope_fn(tiny_model("llama"))  # head_dim 16: pre-RoPE keys need the rotary
    floors: dict = {}
    times = layer_times(keys, values, queries, KVShape(2, 3, 9, 16, 4), [2.5, 5.0], repeats=2, rope=rope,
                        floors=floors)
    assert sorted(times) == ["full", "s4r 2.5", "s4r 2.5 eager", "s4r 2.5 scoring", "s4r 5", "s4r 5 eager",
                             "s4r 5 scoring", "transformers"]
    assert all(ms > 0 for ms in times.values())
    assert sorted(floors) == ["full", "s4r 2.5", "s4r 5"]
    # exact attention reads every key and value: 2 * 901 tokens * 3 heads * 16 dims * 4 bytes
    assert floors["full"][0] == 2 * 901 * 3 * 16 * 4
    assert all(0 < floors[m][0] < floors["full"][0] and floors[m][1] > 0 for m in ("s4r 2.5", "s4r 5"))


def test_the_speed_ceiling_counts_the_model_and_every_layer():
    from s4r.bench.layer_speed import speed_ceiling

    # 40 ms of model work, 30 layers: attention 1 ms a layer against 0.5 ms is 70 / 55 of a step
    assert speed_ceiling(40.0, 30, 1.0, 0.5) == pytest.approx(70 / 55)
    assert speed_ceiling(40.0, 30, 1.0, 1.0) == 1.0
    assert speed_ceiling(40.0, 30, 1.0, 0.0) == pytest.approx(70 / 40)  # attention free: the ceiling


def test_layer_speed_runs_on_a_tiny_model(monkeypatch, capsys):
    from s4r.bench import layer_speed

    monkeypatch.setattr("s4r.models.loading.load_model", lambda name: tiny_loaded())
    assert layer_speed.main(["--lengths", "900", "--ratios", "5", "--prefill", "600", "--layers", "0",
                             "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    assert "model step besides attention" in out
    assert "| 900 |" in out and "x (" in out
    assert "share of floor" in out and "| 900 | s4r 5 |" in out
