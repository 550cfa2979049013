"""The serving library: prompts rendered from messages, sizes, forks that share nothing, the store's
budget and its folder."""

from __future__ import annotations

import pytest

from s4r.serving.forking import fork_cache
from s4r.serving.generate import Sampling
from s4r.serving.prompt import Message, PromptError, render
from s4r.units import parse_size
from tests.helpers import CharTokenizer
from tests.server_fixtures import DOC, OTHER_DOC, make_engine, tiny_loaded


@pytest.fixture(scope="module")
def loaded():
    return tiny_loaded()


def test_sizes_are_read_in_binary_units():
    assert parse_size("512M") == 512 * 2**20 and parse_size("2G") == 2 * 2**30
    assert parse_size("1.5GiB") == 3 * 2**29 and parse_size("1000") == 1000
    for bad in ("", "lots", "-1G", "5X"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_a_prompt_keeps_the_first_user_message_as_the_document_part():
    messages = [Message("system", "Be brief."), Message("user", DOC), Message("user", "Who?")]
    p = render(messages, CharTokenizer())
    assert p.text[p.head_end:p.first_end] == DOC.strip()
    assert p.text.startswith("Be brief.") and p.text.endswith("Who?\nAssistant:")
    assert p.may_end_at(p.first_end) and not p.may_end_at(p.first_end - 2)


@pytest.mark.parametrize("messages", [
    [], [Message("assistant", "hi")], [Message("user", "hi"), Message("assistant", "yo")],
    [Message("user", "hi"), Message("system", "late")], [Message("tool", "x")]])
def test_messages_that_are_no_chat_are_refused(messages):
    with pytest.raises(PromptError):
        render(messages, CharTokenizer())


def test_a_fork_shares_nothing_with_the_document(loaded):
    engine = make_engine(loaded)
    engine.complete([Message("user", DOC), Message("user", "Who?")], Sampling(max_tokens=3))
    doc = engine.store.documents()[0]
    original = doc.session.cache
    before = (original.logical_length(), original.nbytes())
    fork = fork_cache(original, doc.session.rope)
    a = engine.complete([Message("user", DOC), Message("user", "Who?")], Sampling(max_tokens=3))
    b = engine.complete([Message("user", DOC), Message("user", "Who?")], Sampling(max_tokens=3))
    assert a.text == b.text and a.cached_tokens == b.cached_tokens == before[0]
    assert (original.logical_length(), original.nbytes()) == before
    assert fork.nbytes() == original.nbytes() and fork.layers[1] is not original.layers[1]


def test_without_a_folder_a_document_over_the_budget_is_forgotten(loaded):
    engine = make_engine(loaded, budget=1)
    c = engine.complete([Message("user", DOC), Message("user", "Who?")], Sampling(max_tokens=2))
    assert c.cache == "new" and engine.store.documents() == []
    assert engine.store.snapshot().counters.forgotten == 1


def test_a_damaged_saved_cache_is_read_again(loaded, tmp_path):
    engine = make_engine(loaded, budget=0, cache_dir=tmp_path)
    ask = [Message("user", OTHER_DOC), Message("user", "Who?")]
    engine.complete(ask, Sampling(max_tokens=2))
    (saved,) = list(engine.store.folder.glob("*.s4r"))
    saved.write_bytes(saved.read_bytes()[:-64])
    again = make_engine(loaded, budget=0, cache_dir=tmp_path)
    assert again.complete(ask, Sampling(max_tokens=2)).cache == "new"
    assert again.store.snapshot().counters.load_failures == 1


@pytest.mark.parametrize("argv", [["--memory-budget", "lots"], ["--max-request-bytes", "-1G"],
                                  ["--load", "saved.s4r"]])
def test_bad_serve_options_exit_2_before_any_model_loads(argv, capsys):
    from s4r_cli.app import run

    assert run(["serve", *argv]) == 2
    assert capsys.readouterr().err.startswith("s4r: error:")
