"""`s4r serve` as a user starts it: the command in a subprocess with the embedded model, on loopback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from s4r.books import book_text

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_the_command_serves_the_embedded_model_and_reuses_a_document(tmp_path):
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "s4r_cli", "serve", "--threads", "1", "--port", str(port), "--api-key", "k",
           "--max-new-tokens", "8", "--cache-dir", str(tmp_path)]
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0, timeout=300)
        model = c.models.list().data[0].id
        document = book_text("pride-and-prejudice")[:6000]
        replies = [c.chat.completions.create(model=model, messages=[
            {"role": "user", "content": document}, {"role": "user", "content": question}])
            for question in ("Who is Mr. Bingley?", "Who is Mrs. Bennet?")]
        assert all(r.choices[0].message.content.strip() for r in replies)
        assert replies[0].usage.prompt_tokens_details.cached_tokens == 0
        assert replies[1].usage.prompt_tokens_details.cached_tokens > 1000
        assert replies[1].model_extra["s4r"]["ratio"] > 4
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="no", max_retries=0).models.list()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
