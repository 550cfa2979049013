"""Launching s4r on several loopback ranks the way torchrun does (RANK, WORLD_SIZE, MASTER_ADDR/PORT in
each process's environment), and a tiny model folder with 4 KV heads and a character tokenizer."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# every wait on another rank inside s4r; the launches below are bounded separately
RANK_TIMEOUT_S = 60
LAUNCH_TIMEOUT_S = 400


@dataclass
class RankResult:
    """What one rank left: exit code, stdout, stderr."""

    code: int
    out: str
    err: str


def free_port() -> int:
    """A TCP port nothing listens on now (loopback)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_env(rank: int, size: int, port: int) -> dict[str, str]:
    """The environment torchrun gives rank `rank` of `size`, on loopback."""
    env = dict(os.environ)
    env.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(size),
                "LOCAL_WORLD_SIZE": str(size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1", "S4R_DIST_TIMEOUT": str(RANK_TIMEOUT_S), "PYTHONPATH": str(ROOT),
                "HF_HUB_OFFLINE": "1"})
    if size == 1:
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key)
    return env


def start_ranks(size: int, argv: list[str], stdin: str = "",
                ranks: range | None = None) -> list[subprocess.Popen]:
    """Start `python -m s4r_cli ARGV` as ranks 0..size-1 (or only `ranks` of them); rank 0 gets `stdin`."""
    port = free_port()
    procs = []
    for rank in ranks if ranks is not None else range(size):
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "s4r_cli", *argv], env=rank_env(rank, size, port), cwd=ROOT,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True))
    procs[0].stdin.write(stdin)
    for proc in procs:
        proc.stdin.close()
        proc.stdin = None  # communicate() must not flush it again
    return procs


def wait_ranks(procs: list[subprocess.Popen], timeout: float = LAUNCH_TIMEOUT_S) -> list[RankResult]:
    """Wait for every rank (killing all of them past `timeout`, which fails the test)."""
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            results.append(RankResult(proc.returncode, out, err))
    except subprocess.TimeoutExpired:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"the ranks did not end within {timeout} s") from None
    return results


def await_output(proc: subprocess.Popen, timeout: float = LAUNCH_TIMEOUT_S) -> str:
    """Wait until `proc` writes something to stdout (its answer has begun) and return what it wrote then
    (taken from what `wait_ranks` will see)."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise AssertionError(f"rank 0 wrote nothing within {timeout} s")
    return os.read(proc.stdout.fileno(), 65536).decode(errors="replace")


def launch(size: int, argv: list[str], stdin: str = "") -> list[RankResult]:
    """Run `python -m s4r_cli ARGV` on `size` loopback ranks and wait for all."""
    return wait_ranks(start_ranks(size, argv, stdin))


def char_tokenizer(folder: Path) -> None:
    """Save a character-level fast tokenizer with ChatML's special tokens into `folder`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>",
                                   bos_token="<|im_start|>", additional_special_tokens=specials[1:])
    fast.save_pretrained(folder)


def tiny_model_dir(folder: Path, **overrides: Any) -> Path:
    """A seeded random llama with 8 query and 4 KV heads (two layers) and its tokenizer, saved to `folder`
    (`overrides` replace config values)."""
    from tests.helpers import tiny_model

    model = tiny_model("llama", num_attention_heads=8, num_key_value_heads=4, eos_token_id=2, bos_token_id=1,
                       **overrides)
    model.save_pretrained(folder)
    char_tokenizer(folder)
    return folder
