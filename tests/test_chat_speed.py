"""The chat-speed bench: a two-document conversation per session kind, its ratios to the full cache, and
the block sweep of one layer (on a tiny random model; speed itself is measured in the bench only)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from s4r.bench import chat_speed
from tests.helpers import CharTokenizer, tiny_model

# characters are tokens: two documents long enough for the second to get a segment of its own
DOCS = ("the quiet harbour keeps its boats. " * 45, "a baker named the shop the blue heron. " * 40)


def tiny_loaded() -> SimpleNamespace:
    return SimpleNamespace(model=tiny_model("llama", num_hidden_layers=2), tokenizer=CharTokenizer(),
                           name="tiny", device="cpu", dtype=torch.float32, context_length=8192)


def test_measure_gives_the_full_row_first_and_ratios_to_it(monkeypatch):
    runs = []
    real = chat_speed.one_chat

    def counted(loaded, method, ratio, docs, answer_tokens):
        runs.append((method, answer_tokens))
        return real(loaded, method, ratio, docs, answer_tokens)

    monkeypatch.setattr(chat_speed, "one_chat", counted)
    rows = chat_speed.measure(tiny_loaded(), [("s4r", 2.5)], DOCS, repeats=2, answer_tokens=3)
    assert [r.name for r in rows] == ["full", "s4r@2.5"]
    # one warm-up, then every kind once per repetition, in turn
    assert runs[1:] == [("full", 3), ("s4r", 3), ("full", 3), ("s4r", 3)]
    full, s4r = rows
    assert full.read_ratio == full.prompt_ratio == full.answer_ratio == 1.0 and full.kv_ratio == 1.0
    assert s4r.kv_ratio > 1.5  # the compressed session reports what it achieved
    assert abs(s4r.read_ratio - s4r.read_s / full.read_s) < 1e-12
    assert abs(s4r.answer_ratio - s4r.answer_tok_s / full.answer_tok_s) < 1e-12
    table = chat_speed.markdown(rows)
    assert table.splitlines()[2].startswith("| full | 1.00 |") and "| s4r@2.5 |" in table


def test_the_block_sweep_times_both_paths_for_every_size():
    sweep = chat_speed.block_sweep(tiny_loaded(), "s4r", 2.5, DOCS, [1, 4], repeats=2)
    assert [q for q, _, _ in sweep] == [1, 4]
    assert all(chosen > 0 and dense > 0 for _, chosen, dense in sweep)
    assert "| 4 |" in chat_speed.sweep_markdown(sweep)


def test_documents_are_consecutive_passages_of_the_book():
    from s4r.books import load_book

    tok = CharTokenizer()
    ids = tok.encode(load_book("saltmere"))
    one, two = chat_speed.documents(tok, 300, 200, "saltmere")
    start = len(ids) // 4
    assert one == tok.decode(ids[start : start + 300]) and two == tok.decode(ids[start + 300 : start + 500])


def test_a_method_carries_its_settings_and_a_bad_one_is_refused_before_loading(monkeypatch, capsys):
    seen = []
    real = chat_speed.method_spec
    monkeypatch.setattr(chat_speed, "method_spec", lambda spec: seen.append(spec) or real(spec))
    rows = chat_speed.measure(tiny_loaded(), [("s4r+dense_queries=0", 2.5)], DOCS, repeats=1, answer_tokens=2)
    assert rows[1].name == "s4r+dense_queries=0@2.5" and "s4r+dense_queries=0" in seen

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded for a bad setting")

    monkeypatch.setattr("s4r.models.loading.load_model", no_model)
    assert chat_speed.main(["--methods", "s4r+no_such_setting=1"]) == 2
    assert capsys.readouterr().err.startswith("error:")
