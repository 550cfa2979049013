"""The tuning runs' figure: NLL of the reference answer, teacher-forced through a session's cache."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from research.tuning import (
    TUNING_VARIANTS,
    VariantResult,
    answer_fit,
    answer_nll,
    compare_variants,
    perplexity_gaps,
)
from s4r.bench.tasks import Sample
from s4r.runtime.session import Session
from tests.helpers import CharTokenizer
from tests.test_methods import model_for


def _loaded():
    return SimpleNamespace(model=model_for(), tokenizer=CharTokenizer(), name="tiny", device="cpu",
                           dtype=torch.float32, context_length=4096)


def test_answer_nll_is_the_teacher_forced_loss_and_leaves_the_cache_as_it_was():
    loaded = _loaded()
    sample = Sample("niah_single_noise", "The grass is green. " * 20, "What colour?", ["green"], "all", None,
                    "The colour is")
    session = Session(loaded, method="full")
    session.ingest(sample.context)
    before = session.logical_length
    nll = answer_nll(session, sample)
    assert session.logical_length == before
    assert answer_nll(session, sample) == nll  # repeatable: nothing of the first call stayed behind
    # token by token (as generation feeds the answer) or in one chunk: the same loss on a full cache
    assert abs(answer_nll(session, sample, stepwise=False) - nll) < 1e-4
    # the same loss computed by hand with a fresh session
    fresh = Session(loaded, method="full")
    fresh.ingest(sample.context)
    tok = loaded.tokenizer
    prompt = tok.encode(fresh._turn_prefix() + sample.question + fresh.segments.to_assistant
                        + sample.answer_prefix)
    answer = tok.encode(" green.")
    ids = torch.tensor([prompt + answer])
    with torch.inference_mode():
        out = loaded.model(input_ids=ids, position_ids=torch.arange(before, before + ids.shape[1])[None],
                           cache=fresh.cache, use_cache=True)
    logp = torch.log_softmax(out.logits[0, len(prompt) - 1 : -1].float(), dim=-1)
    expected = -logp.gather(1, torch.tensor(answer)[:, None]).mean().item()
    assert abs(nll - expected) < 1e-4
    # the greedy margin: per answer token before the full stop, the reference's log-probability minus the
    # best other token's; the smallest of them
    margins = []
    for row, token in zip(logp[:-1], answer[:-1], strict=True):
        others = torch.cat([row[:token], row[token + 1 :]])
        margins.append((row[token] - others.max()).item())
    fit = answer_fit(session, sample)
    assert fit.nll == nll and abs(fit.margin - min(margins)) < 1e-4


def test_the_chat_margin_is_measured_after_the_other_question_and_leaves_the_documents():
    from research.two_documents import chat_fit

    loaded = _loaded()
    first = Sample("niah_single_noise", "The grass is green. " * 20, "What colour?", ["green"], "all", None,
                   "The colour is")
    second = Sample("niah_single_noise", "", "What shape?", ["round"], "all", None, "The shape is")
    session = Session(loaded, method="full")
    session.ingest(first.context)
    before = session.logical_length
    fit = chat_fit(session, first, second)
    assert session.logical_length == before and session.ask("x", max_new_tokens=1)  # still usable
    session.clear()
    # by hand: the first question answered with its reference, as a turn, then the second's fit
    session.ask(first.question, prime=f"{first.answer_prefix} green.", max_new_tokens=0)
    assert session.logical_length > before
    assert answer_fit(session, second) == fit


def test_compare_variants_pairs_every_variant_with_the_full_cache():
    results = compare_variants(_loaded(), {"default": TUNING_VARIANTS["default"]},
                               tasks=["niah_single_noise"], length=700, samples=2, ratio=2.0)
    assert set(results) == {"full", "default"}
    assert len(results["full"].nll) == len(results["default"].nll) == 2
    assert all(r >= 2.0 for r in results["default"].ratio)
    gap = results["default"].gap(results["full"])
    assert gap.n == 2 and gap.low <= gap.mean <= gap.high
    assert VariantResult("x", {}, nll=[1.0, 2.0]).gap(VariantResult("f", {}, nll=[1.0, 1.0])).mean == 0.5


def test_perplexity_gaps_fork_every_variant_from_one_prefill():
    gaps = perplexity_gaps(_loaded(), {"int8": TUNING_VARIANTS["int8+out0.05"]}, length=1200, continuation=24,
                           ratio=2.0)
    assert set(gaps) == {"full", "int8"}
    full_nll, full_ratio = gaps["full"]
    nll, ratio = gaps["int8"]
    assert full_ratio == 1.0 and ratio >= 2.0
    assert full_nll > 0 and nll > 0 and nll != full_nll  # compression changed the continuation's loss


def test_two_documents_record_each_arms_greedy_answers_for_the_diagnosis():
    from research.two_documents import run_pairs, summary

    notes: list[str] = []
    arms = run_pairs(_loaded(), {"segments": {}}, length=600, samples=1, ratio=2.0, book="romeo-and-juliet",
                     second_book="romeo-and-juliet", task="niah_single_noise", note=notes.append)
    for arm in arms.values():
        assert [len(a) for a in arm.answers] == [len(s) for s in arm.scores] == [1, 1]
    assert "answers full" in notes[-1] and repr(arms["segments"].answers[1][0].strip()) in notes[-1]
    assert list(summary(arms)["segments"]["raw"]["answers"]) == list(arms["segments"].answers)


def test_a_long_chat_asks_every_needle_of_both_documents_in_turn():
    from research.long_chat import chat_questions

    tok = CharTokenizer()
    doc1, doc2, questions = chat_questions(900, 3, 7, lambda s: len(tok.encode(s)), "romeo-and-juliet")
    assert len(questions) == 6
    numbers = [q.answers[0] for q in questions]
    assert len(set(numbers)) == 6 and len({q.question for q in questions}) == 6
    for i, q in enumerate(questions):  # documents take turns; each number is in its document only
        mine, other = (doc1, doc2) if i % 2 == 0 else (doc2, doc1)
        assert q.context == mine and q.answers[0] in mine and q.answers[0] not in other


def test_a_long_chat_scores_every_question_and_keeps_the_ratio_to_the_end():
    from research.long_chat import run_chats, summary

    notes: list[str] = []
    arms = run_chats(_loaded(), {"s4r": {}}, length=700, keys=2, pairs=2, ratio=2.0, book="romeo-and-juliet",
                     note=notes.append)
    for arm in arms.values():
        assert [len(r) for r in arm.scores] == [len(a) for a in arm.answers] == [4, 4]
    assert arms["full"].ratio == [1.0, 1.0]
    assert all(r >= 2.0 for r in arms["s4r"].ratio)  # four questions and answers later, still within 1/2
    assert len(notes) == 2 and notes[-1].startswith("pair 2: full ")
    result = summary(arms)
    assert len(result["s4r"]["positions"]) == 4 and result["full"]["late"]["gap"] == 0.0
    assert result["s4r"]["early"]["n"] == 2
