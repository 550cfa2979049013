"""`s4r serve`'s app on a real loopback server over a tiny random model, driven with the openai client."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tests.server_fixtures import DOC, MODEL_ID, OTHER_DOC, make_engine, metric, serving, tiny_loaded

QUESTION = "Who jumps over the dog?"


@pytest.fixture(scope="module")
def loaded():
    return tiny_loaded()


def client(server, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key=key, max_retries=0, timeout=60)


def ask(c: openai.OpenAI, doc: str, question: str = QUESTION, **kw):
    return c.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": doc},
                                                               {"role": "user", "content": question}], **kw)


def test_plain_and_streamed_answers_and_a_second_question_reuses_the_document(loaded):
    with serving(make_engine(loaded)) as server:
        c = client(server)
        first = ask(c, DOC)
        assert first.choices[0].message.role == "assistant"
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert first.model_extra["s4r"]["cache"] == "new"
        second = ask(c, DOC, "Where is the river?")
        doc_tokens = second.usage.prompt_tokens_details.cached_tokens
        assert doc_tokens > 1000 and second.model_extra["s4r"]["cache"] == "memory"
        # only the question was prefilled: the document's tokens came from its cache
        assert second.model_extra["timings"]["prompt_n"] == second.usage.prompt_tokens - doc_tokens < 40
        pieces = [ch for ch in ask(c, DOC, stream=True, stream_options={"include_usage": True})]
        text = "".join(ch.choices[0].delta.content or "" for ch in pieces if ch.choices)
        assert text == first.choices[0].message.content
        assert pieces[-1].usage.prompt_tokens_details.cached_tokens == doc_tokens
        page = httpx.get(f"{server.root}/metrics").text
        assert metric(page, "s4r_document_ingests_total") == 1
        assert metric(page, "s4r_requests_total") == 3
        assert metric(page, "s4r_cache_hits_total") == 2  # memory hits
        assert metric(page, "s4r_kv_ratio") > 2


def test_the_stream_is_server_sent_events_ending_in_done(loaded):
    with serving(make_engine(loaded)) as server:
        body = {"model": MODEL_ID, "stream": True, "messages": [{"role": "user", "content": "Hi there"}]}
        with httpx.stream("POST", f"{server.url}/chat/completions", json=body, timeout=60) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            lines = [ln for ln in r.iter_lines() if ln]
        assert lines[-1] == "data: [DONE]"
        last = json.loads(lines[-2].removeprefix("data: "))
        assert last["choices"][0]["finish_reason"] in ("stop", "length") and "timings" in last


def test_a_restarted_server_serves_a_saved_document_from_disk(loaded, tmp_path):
    with serving(make_engine(loaded, cache_dir=tmp_path)) as server:
        before = ask(client(server), DOC)
    with serving(make_engine(loaded, cache_dir=tmp_path)) as server:
        after = ask(client(server), DOC)
        page = httpx.get(f"{server.root}/metrics").text
    assert after.model_extra["s4r"]["cache"] == "disk"
    assert after.usage.prompt_tokens_details.cached_tokens == (before.usage.prompt_tokens
        - before.model_extra["timings"]["prompt_n"])
    assert metric(page, "s4r_document_ingests_total") == 0
    assert after.choices[0].message.content == before.choices[0].message.content


def status_of(call) -> int:
    try:
        call()
    except openai.APIStatusError as exc:
        assert set(exc.body) >= {"message", "type", "code"}  # the client hands over the inner error
        return exc.status_code
    return 200


def test_bad_requests_get_their_statuses_and_the_server_keeps_serving(loaded):
    with serving(make_engine(loaded), max_request_bytes=20_000) as server:
        c = client(server)
        url = f"{server.url}/chat/completions"
        assert status_of(lambda: c.chat.completions.create(model="other", messages=[
            {"role": "user", "content": "hi"}])) == 404
        assert status_of(lambda: c.chat.completions.create(model=MODEL_ID, messages=[
            {"role": "assistant", "content": "hi"}])) == 400
        assert status_of(lambda: c.chat.completions.create(model=MODEL_ID, messages=[])) == 400
        assert status_of(lambda: c.chat.completions.create(model=MODEL_ID, max_tokens=10**6, messages=[
            {"role": "user", "content": "hi"}])) == 400
        too_long = "word " * 3000  # 15,000 tokens: over the 4,096-token context, under the body limit
        assert status_of(lambda: ask(c, too_long)) == 413
        for raw, status in ((b"{not json", 400), (b"[1]", 400), (b"x" * 30_000, 413)):
            r = httpx.post(url, content=raw, headers={"content-type": "application/json"})
            assert r.status_code == status and set(r.json()["error"]) >= {"message", "type", "code"}
        r = httpx.get(f"{server.root}/nowhere")
        assert r.status_code == 404 and "error" in r.json()
        assert ask(c, "Just a short question?").choices[0].finish_reason in ("stop", "length")


def test_a_wrong_or_missing_key_gets_401(loaded):
    with serving(make_engine(loaded), api_key="sesame") as server:
        assert status_of(lambda: ask(client(server, "wrong"), "hi")) == 401
        assert httpx.get(f"{server.url}/models").status_code == 401
        assert httpx.get(f"{server.root}/health").status_code == 200
        assert client(server, "sesame").models.list().data[0].id == MODEL_ID
        assert ask(client(server, "sesame"), "hi").choices


def test_a_full_queue_gets_503_and_a_client_that_leaves_stops_its_answer(loaded):
    engine = make_engine(loaded)
    engine._stop_ids = set()  # the random model's answer runs to its token limit unless stopped
    with serving(engine, max_queue=1, max_tokens_limit=5000) as server:
        body = {"model": MODEL_ID, "stream": True, "max_tokens": 4000,
                "messages": [{"role": "user", "content": "Tell me a long story."}]}
        with httpx.stream("POST", f"{server.url}/chat/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()  # kept: a dropped iterator closes the response
            next(lines)  # the answer has started
            assert status_of(lambda: ask(client(server), "hi")) == 503
        deadline = time.monotonic() + 30
        while metric(httpx.get(f"{server.root}/metrics").text, "s4r_requests_cancelled_total") < 1:
            assert time.monotonic() < deadline, "the answer went on after its client left"
            time.sleep(0.1)
        assert ask(client(server), "hi").choices  # the queue is free again


def test_a_budget_keeps_the_least_recently_used_document_on_disk_only(loaded, tmp_path):
    engine = make_engine(loaded, cache_dir=tmp_path)
    with serving(engine) as server:
        c = client(server)
        one = ask(c, DOC).model_extra["s4r"]
        engine.store.budget_bytes = int(one["kv_bytes"] * 1.5)  # room for one document
        ask(c, OTHER_DOC)
        assert ask(c, DOC).model_extra["s4r"]["cache"] == "disk"
        assert ask(c, DOC).model_extra["s4r"]["cache"] == "memory"
        page = httpx.get(f"{server.root}/metrics").text
    assert metric(page, "s4r_kv_resident_bytes") <= engine.store.budget_bytes
    assert metric(page, "s4r_documents_resident") == 1 and metric(page, "s4r_documents_saved") == 2
