"""Hidden states spilled to a temporary file between layers: the same results, and no file left behind."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from s4r.core.budget import KVShape
from s4r.errors import S4RError
from s4r.hf.attention import install
from s4r.hf.cache import CompressedCache
from s4r.hf.hidden_spill import SPILL_MIN_BYTES, HiddenSpill, filesystem_type, spill_wanted
from s4r.hf.layerwise import layerwise_prefill
from s4r.runtime.session import Session
from tests.helpers import ARCHS, CharTokenizer, tiny_model

TEXT = "".join(chr(97 + (i * 7919) % 26) for i in range(900))
PROC_FDS = Path("/proc/self/fd")
needs_proc = pytest.mark.skipif(not PROC_FDS.is_dir(), reason="needs /proc/self/fd (Linux)")


def files_open_in(directory: Path) -> list[str]:
    """What this process has open in `directory` (an unnamed temp file shows as 'dir/#123 (deleted)')."""
    found = []
    for fd in PROC_FDS.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith(str(directory) + os.sep):
            found.append(target)
    return found


def files_in(directory: Path) -> list[Path]:
    """Files left in `directory` (torch may add folders of its own to the temp dir)."""
    return [path for path in directory.iterdir() if path.is_file()]


@pytest.fixture
def temp_dir(tmp_path, monkeypatch) -> Path:
    """The system temp dir, pointed at an empty folder of this test."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def loaded_for(model):
    dtype = next(model.parameters()).dtype
    return SimpleNamespace(model=model, tokenizer=CharTokenizer(), name="tiny", device="cpu",
                           dtype=dtype, context_length=4096)


@needs_proc
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ARCHS)
def test_spilled_prefill_is_bit_identical(arch, dtype, temp_dir):
    model = tiny_model(arch, dtype=dtype)
    install(model)
    shape = KVShape.from_config(model.config, torch.empty(0, dtype=dtype).element_size())
    ids = torch.randint(0, model.config.vocab_size, (700,), generator=torch.Generator().manual_seed(3))
    caches = {spill: CompressedCache(shape.layers, shape, query_window=16) for spill in (False, True)}
    during: list[list[str]] = []
    logits = {}
    with torch.inference_mode():
        for spill, cache in caches.items():
            # a document then an appended one; 128 does not divide either, so the last blocks are short
            logits[spill] = [layerwise_prefill(model, cache, part, begin, 128,
                                               lambda i: during.append(files_open_in(temp_dir)),
                                               spill=spill)
                             for part, begin in ((ids[:500], 0), (ids[500:], 500))]
    for a, b in zip(logits[True], logits[False], strict=True):
        assert torch.equal(a, b)
    for a, b in zip(caches[True].layers, caches[False].layers, strict=True):
        assert torch.equal(a.keys_view, b.keys_view) and torch.equal(a.values_view, b.values_view)
        assert torch.equal(a.queries, b.queries)
    n = shape.layers * 2
    # no file without the spill; one open, unnamed file in the temp dir during each spilled ingest
    assert during[:n] == [[]] * n
    assert all(len(open_now) == 1 for open_now in during[n:])
    assert not files_open_in(temp_dir) and not files_in(temp_dir)


@needs_proc
@pytest.mark.parametrize("method", ["full", "s4r", "snapkv"])
def test_sessions_with_and_without_the_spill_agree(method, temp_dir):
    loaded = loaded_for(tiny_model("qwen3", dtype=torch.bfloat16))
    results = {}
    for spill in ("on", "off"):
        session = Session(loaded, method=method, ratio=2.0, chunk_size=128, hidden_spill=spill)
        open_then: list[int] = []
        # an append goes the same way
        stats = [session.ingest(text, progress=lambda d, t, seen=open_then: seen.append(
            len(files_open_in(temp_dir)))) for text in (TEXT, TEXT[:300])]
        assert [s.hidden_spilled for s in stats] == [spill == "on"] * 2
        assert open_then == [int(spill == "on")] * 2 * session.shape.layers
        assert all(s.mode == "layerwise" for s in stats)
        answer, _ = session.ask("what?", max_new_tokens=6)
        layers = [(layer.keys_view, layer.values_view) for layer in session.cache.layers] \
            if method == "full" else []
        results[spill] = (answer, session.memory(), session.compress_info, layers)
    on, off = results["on"], results["off"]
    assert on[:3] == off[:3]
    for (k1, v1), (k2, v2) in zip(on[3], off[3], strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    assert not files_in(temp_dir)


@needs_proc
@pytest.mark.parametrize("stop", [KeyboardInterrupt, RuntimeError])
def test_no_file_is_left_after_an_interrupted_or_failed_ingest(stop, temp_dir):
    loaded = loaded_for(tiny_model("llama", num_hidden_layers=4))
    session = Session(loaded, method="s4r", ratio=2.0, chunk_size=128, hidden_spill="on")
    open_then: list[list[str]] = []

    def stop_at_third_layer(done: int, total: int) -> None:
        open_then.append(files_open_in(temp_dir))
        if done >= 3 * total // session.shape.layers:
            raise stop("stopped")

    # the error is kept, with its traceback and the frames it holds, as a REPL or a debugger would:
    # the file must be closed by then, not only once those are garbage
    with pytest.raises(stop) as caught:
        session.ingest(TEXT, progress=stop_at_third_layer)
    assert [len(files) for files in open_then] == [1, 1, 1]  # the spill was in use when it stopped
    assert not files_open_in(temp_dir) and not files_in(temp_dir)
    assert caught.traceback
    assert session.cache is None  # and the session is as before: it can ingest again
    assert session.ingest(TEXT).hidden_spilled


@needs_proc
def test_no_file_is_left_when_the_embedding_fails(temp_dir, monkeypatch):
    model = tiny_model("llama")
    install(model)
    shape = KVShape.from_config(model.config, 4)
    calls = []
    real_write = HiddenSpill.write

    def write_then_fail(self, begin, block):
        calls.append(begin)
        real_write(self, begin, block)
        if len(calls) == 2:
            raise OSError("disk full")

    monkeypatch.setattr(HiddenSpill, "write", write_then_fail)
    ids = torch.arange(300) % 128
    with torch.inference_mode(), pytest.raises(OSError, match="disk full") as caught:
        layerwise_prefill(model, CompressedCache(shape.layers, shape), ids, 0, 128, spill=True)
    assert calls == [0, 128]
    assert not files_open_in(temp_dir) and not files_in(temp_dir)
    assert caught.traceback  # kept alive (see above)


def test_spill_file_round_trips_blocks(tmp_path):
    rows = torch.randn(1, 10, 6).to(torch.bfloat16)
    with HiddenSpill(10, 6, torch.bfloat16, torch.device("cpu"), str(tmp_path)) as spill:
        spill.write(4, rows[:, 4:])
        spill.write(0, rows[:, :4])
        assert torch.equal(spill.read(0, 10), rows)
        assert torch.equal(spill.read(3, 5), rows[:, 3:5])
        spill.write(3, torch.zeros(1, 2, 6))  # written in the file's dtype
        assert not spill.read(3, 5).any() and torch.equal(spill.read(5, 10), rows[:, 5:])
    assert spill.file.closed and not files_in(tmp_path)


def test_auto_spills_long_texts_on_a_cpu_disk(tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/vda / ext4 rw 0 0\ntmpfs /run/ram tmpfs rw 0 0\n")
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    row = 576 * 2  # SmolLM2's hidden states in bf16
    long_text, short_text = SPILL_MIN_BYTES // row + 1, SPILL_MIN_BYTES // row - 1
    assert spill_wanted("auto", long_text, 576, torch.bfloat16, cpu)
    assert not spill_wanted("auto", short_text, 576, torch.bfloat16, cpu)
    assert not spill_wanted("auto", long_text, 576, torch.bfloat16, cuda)
    assert spill_wanted("on", 1, 576, torch.bfloat16, cuda) and not spill_wanted("off", long_text, 576,
                                                                                  torch.bfloat16, cpu)
    assert filesystem_type("/run/ram/x", str(mounts)) == "tmpfs"
    assert filesystem_type("/run/ramdisk", str(mounts)) == "ext4"
    assert filesystem_type("/tmp", str(tmp_path / "none")) is None
    with pytest.raises(ValueError):
        spill_wanted("sometimes", 1, 576, torch.bfloat16, cpu)


def test_auto_does_not_spill_into_memory(monkeypatch):
    monkeypatch.setattr("s4r.hf.hidden_spill.filesystem_type", lambda path: "tmpfs")
    assert not spill_wanted("auto", 10**6, 576, torch.bfloat16, torch.device("cpu"))


def test_auto_session_spills_only_long_texts(temp_dir, monkeypatch):
    loaded = loaded_for(tiny_model("llama"))
    # 64 fp32 values a token: 900 tokens are 225 KiB
    monkeypatch.setattr("s4r.hf.hidden_spill.SPILL_MIN_BYTES", 100 * 1024)
    monkeypatch.setattr("s4r.hf.hidden_spill.filesystem_type", lambda path: "ext4")
    session = Session(loaded, method="full")
    assert session.ingest(TEXT).hidden_spilled
    assert not session.ingest(TEXT[:200]).hidden_spilled
    with pytest.raises(S4RError):
        Session(loaded, hidden_spill="maybe")


def test_stats_say_when_the_hidden_states_were_in_a_file():
    from s4r_cli.ui import process_memory_text

    proc = SimpleNamespace(peak_bytes=2**30, current_bytes=None, kind="RSS")
    spilled = process_memory_text(proc, SimpleNamespace(mode="layerwise", hidden_spilled=True))
    assert spilled.endswith("ingested layerwise (hidden states in a temp file)")
    in_memory = process_memory_text(proc, SimpleNamespace(mode="layerwise", hidden_spilled=False))
    assert "temp file" not in in_memory
