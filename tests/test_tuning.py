"""The tuning runs' figure: NLL of the reference answer, teacher-forced through a session's cache."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from s4r.bench.tasks import Sample
from s4r.bench.tuning import (
    TUNING_VARIANTS,
    VariantResult,
    answer_fit,
    answer_nll,
    compare_variants,
    perplexity_gaps,
)
from s4r.session import Session
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
    from s4r.bench.two_documents import chat_fit

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
    from s4r.bench.two_documents import run_pairs, summary

    notes: list[str] = []
    arms = run_pairs(_loaded(), {"segments": {}}, length=600, samples=1, ratio=2.0, book="romeo-and-juliet",
                     second_book="romeo-and-juliet", task="niah_single_noise", note=notes.append)
    for arm in arms.values():
        assert [len(a) for a in arm.answers] == [len(s) for s in arm.scores] == [1, 1]
    assert "answers full" in notes[-1] and repr(arms["segments"].answers[1][0].strip()) in notes[-1]
    assert list(summary(arms)["segments"]["raw"]["answers"]) == list(arms["segments"].answers)
