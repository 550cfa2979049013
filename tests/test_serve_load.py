"""A bounded load on a loopback `s4r serve` app: several clients at once over three documents."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai

from tests.server_fixtures import DOC, MODEL_ID, OTHER_DOC, make_engine, metric, serving, tiny_loaded

THIRD_DOC = "Seven lanterns hung along the quay, and the ferryman lit them one by one. " * 22
QUESTIONS = ("Who is there?", "What happens next?", "Where does it end?", "Why?")
CLIENTS, ROUNDS = 4, 4


def test_concurrent_clients_lose_no_request_mix_no_conversation_and_keep_the_budget(tmp_path):
    loaded = tiny_loaded()
    engine = make_engine(loaded, cache_dir=tmp_path)
    docs = (DOC, OTHER_DOC, THIRD_DOC)
    jobs = [(docs[(c + r) % 3], QUESTIONS[(c * ROUNDS + r) % 4])
            for c in range(CLIENTS) for r in range(ROUNDS)]
    with serving(engine, max_queue=CLIENTS + 1) as server:
        c = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=120)

        def ask(job: tuple[str, str]) -> str:
            doc, question = job
            reply = c.chat.completions.create(model=MODEL_ID, messages=[
                {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": doc},
                {"role": "user", "content": question}])
            return reply.choices[0].message.content

        # each distinct conversation answered alone first: greedy answers depend on nothing else
        alone = {job: ask(job) for job in sorted(set(jobs))}
        one = engine.store.documents()[0].stored_bytes
        engine.store.budget_bytes = int(one * 2.5)  # two of the three documents fit
        peaks: list[int] = []
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                peaks.append(int(metric(httpx.get(f"{server.root}/metrics").text, "s4r_kv_resident_bytes")))
                done.wait(0.05)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            with ThreadPoolExecutor(CLIENTS) as pool:
                answers = list(pool.map(ask, jobs, timeout=300))
        finally:
            done.set()
            watcher.join()
        page = httpx.get(f"{server.root}/metrics").text
    assert answers == [alone[job] for job in jobs]
    assert metric(page, "s4r_requests_total") == len(jobs) + len(alone)
    assert metric(page, "s4r_document_ingests_total") == 3  # each document read once
    assert peaks and max(peaks) <= engine.store.budget_bytes
    assert metric(page, "s4r_cache_evictions_total") > 0  # the budget did make documents leave memory
