"""`s4r serve` on loopback CPU ranks (gloo), launched as torchrun launches: rank 0 serves, rank 1 runs
the same engine calls. A tiny llama with 4 KV heads at 2 ranks answers as one process does (greedy),
a client that leaves stops the answer on both ranks, SIGTERM ends every rank cleanly, and a dead
follower ends the answer with a JSON error and rank 0 with one line."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.ranks_fixtures import LAUNCH_TIMEOUT_S, free_port, start_ranks, tiny_model_dir, wait_ranks
from tests.server_fixtures import DOC, metric

MODEL = "tiny"
QUESTIONS = ("Who jumps over the dog?", "Where is the river?")


def serve_argv(model: Path, port: int, *method: str) -> list[str]:
    return ["serve", "--model", str(model), "--threads", "1", "--dtype", "fp32", "--port", str(port),
            "--served-model-name", MODEL, "--max-new-tokens", "12", "--no-loop-guard",
            "--min-document-tokens", "100", "--max-tokens-limit", "4000", *method]


def wait_healthy(port: int, procs) -> None:
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while True:
        assert all(p.poll() is None for p in procs), f"a rank ended: {procs[0].poll()}"
        assert time.monotonic() < deadline, "the server did not start"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory):
    """Three servers started together (their start-ups overlap), each as (port, processes): "two" at 2
    ranks and "one" in one process keep whole caches (so both hold the same cache), "doomed" at 2 ranks
    compresses at ratio 2."""
    # weights ten times the usual scale: the answers depend on the question (at the usual scale every
    # question gets the same few characters)
    model = tiny_model_dir(tmp_path_factory.mktemp("serve-ranks") / "tiny", initializer_range=0.2)
    ports: list[int] = []
    while len(ports) < 3:
        if (port := free_port()) not in ports:
            ports.append(port)
    whole = ("--method", "full")
    launches = (("two", 2, whole), ("one", 1, whole), ("doomed", 2, ("--ratio", "2")))
    running = {name: (port, start_ranks(size, serve_argv(model, port, *method)))
               for (name, size, method), port in zip(launches, ports, strict=True)}
    try:
        for port, procs in running.values():
            wait_healthy(port, procs)
        yield running
    finally:
        for _, procs in running.values():
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)


def client(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)


def ask(port: int, question: str, **kw):
    return client(port).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": DOC}, {"role": "user", "content": question}], **kw)


def streamed(port: int, question: str) -> str:
    chunks = ask(port, question, stream=True)
    return "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)


def long_stream(port: int):
    body = {"model": MODEL, "stream": True, "max_tokens": 4000,
            "messages": [{"role": "user", "content": "Tell me a long story."}]}
    return httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120)


def test_two_ranks_serve_as_one_process_and_end_together_on_sigterm(servers):
    seen = {}
    for name in ("one", "two"):
        port = servers[name][0]
        first, second = ask(port, QUESTIONS[0]), ask(port, QUESTIONS[1])
        assert first.model_extra["s4r"]["cache"] == "new" and second.model_extra["s4r"]["cache"] == "memory"
        page = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        seen[name] = {"answers": (first.choices[0].message.content, second.choices[0].message.content,
                                  streamed(port, QUESTIONS[0])),
                      "cached": second.usage.prompt_tokens_details.cached_tokens,
                      "kv_bytes": first.model_extra["s4r"]["kv_bytes"],
                      "resident": metric(page, "s4r_kv_resident_bytes")}
    one = seen["one"]["answers"]
    assert one[0] and one[0] != one[1] and one[2] == one[0]  # answers that depend on the question
    assert seen["two"] == seen["one"]  # the same text, the cache's bytes counted over both ranks

    port, procs = servers["two"]
    with long_stream(port) as r:
        lines = r.iter_lines()  # kept: a dropped iterator closes the response
        next(lines)  # the answer has started; leaving now cancels it on rank 0, and rank 1 with it
    deadline = time.monotonic() + 60
    while metric(httpx.get(f"http://127.0.0.1:{port}/metrics").text, "s4r_requests_cancelled_total") < 1:
        assert time.monotonic() < deadline, "the answer went on after its client left"
        time.sleep(0.2)
    assert ask(port, QUESTIONS[1]).choices[0].message.content == one[1]  # the ranks are still in step

    os.kill(procs[0].pid, signal.SIGTERM)
    results = wait_ranks(procs, timeout=60)
    assert [r.code for r in results] == [0, 0], results[0].err
    assert "error" not in results[0].err and results[1].err == "" and results[1].out == ""


def test_a_dead_follower_ends_the_answer_with_a_json_error_and_rank_0_in_one_line(servers):
    port, procs = servers["doomed"]
    first, second = ask(port, QUESTIONS[0]), ask(port, QUESTIONS[1])
    held = first.model_extra["s4r"]
    assert held["cache"] == "new" and held["kv_full_bytes"] >= 2 * held["kv_bytes"]
    assert second.model_extra["s4r"]["cache"] == "memory"
    assert second.usage.prompt_tokens_details.cached_tokens > 1000
    with long_stream(port) as r:
        lines = (line for line in r.iter_lines() if line)
        assert "content" in next(lines)  # the answer is running on both ranks
        os.killpg(procs[1].pid, signal.SIGKILL)
        rest = list(lines)
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2].removeprefix("data: "))["error"]
    assert error["code"] == "rank_lost" and "another rank stopped" in error["message"]
    results = wait_ranks(procs, timeout=60)
    assert results[0].code != 0
    lines = [line for line in results[0].err.splitlines() if line.strip()]
    assert [line for line in lines if "error" in line] == [lines[-1]], results[0].err
    assert lines[-1].startswith("s4r: error: another rank stopped"), results[0].err
