"""The books shipped inside the package (nothing outside the repository is needed) and the thread policy."""

from __future__ import annotations

import lzma
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from s4r import books
from s4r.bench import tasks
from s4r.runtime import threads
from s4r.runtime.threads import auto_threads, choose_threads

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_books_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(books.BOOKS_ENV, raising=False)


def test_books_ship_inside_the_package(no_books_dir: None) -> None:
    names = [b.name for b in books.list_books()]
    assert names == ["pride-and-prejudice", "romeo-and-juliet", "saltmere"]
    for book in books.list_books():
        assert book.shipped and book.path.parent == Path(books.__file__).resolve().parent / "data"
        assert book.path.name.endswith(".txt" if book.name == "saltmere" else ".txt.xz")
    text = books.read_book("pride-and-prejudice")
    assert "It is a truth universally acknowledged" in text
    assert "Project Gutenberg License" in text  # the license travels with the text
    body = books.book_body("pride-and-prejudice")
    assert body.startswith("[Illustration") or "PRIDE" in body[:2000].upper()
    assert "*** START OF" not in body and "*** END OF" not in body


def test_a_wheel_carries_the_books_and_the_profiles(tmp_path: Path) -> None:
    """`pip install .` (not editable) gets what `--book` and `--model` read: build the wheel, list it.
    Built from a copy without build outputs: setuptools packs a stale build/lib whatever the globs say."""
    pytest.importorskip("setuptools")
    source = tmp_path / "source"
    shutil.copytree(REPO_ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".ruff_cache",
        "out*"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path), str(source)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = tmp_path.glob("s4r-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"s4r/data/pride-and-prejudice.txt.xz", "s4r/data/romeo-and-juliet.txt.xz",
            "s4r/data/saltmere.txt", "s4r/data/README.md"} <= names
    shipped = {Path(n).stem for n in names if n.startswith("s4r/profiles/") and n.endswith(".toml")}
    assert shipped == {p.stem for p in (REPO_ROOT / "s4r" / "profiles").glob("*.toml")} and shipped
    assert "s4r_cli/app.py" in names and not any(n.startswith(("research/", "tests/")) for n in names)


def test_the_readme_example_ships_and_states_what_command_one_asks(no_books_dir: None) -> None:
    """`--book saltmere` reads the invented letter from the package; the bakery's name, which the README's
    first command asks for, is in it; and it is long enough that ratio 5 compresses it (about 3,300
    tokens: far above the few hundred below which the cache is kept uncompressed)."""
    book = books.find_book("saltmere")
    assert book.shipped and book.path == books.SHIPPED_DIR / "saltmere.txt"
    text = books.book_text("saltmere")
    assert text.startswith("A Summer in Saltmere") and text.rstrip().endswith("Clara")
    assert "I have named the shop the Blue Heron" in text
    assert 2_500 <= len(text.split()) <= 3_200  # 2,793 words: ~3,300 SmolLM2 tokens
    assert "\n\n" in text and "  " not in text  # paragraphs kept, no layout residue


def test_bench_and_offline_read_the_shipped_books(no_books_dir: None) -> None:
    tasks.load_book.cache_clear()
    assert books.books_dir() == books.SHIPPED_DIR
    assert "Romeo" in tasks.load_book("romeo-and-juliet")[:5000]


def test_books_dir_adds_books_and_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "extra.txt").write_text("*** START OF X ***\nHello.\n*** END OF X ***\n")
    with lzma.open(tmp_path / "romeo-and-juliet.txt.xz", "wt", encoding="utf-8") as f:
        f.write("my own copy")
    monkeypatch.setenv(books.BOOKS_ENV, str(tmp_path))
    found = {b.name: b for b in books.list_books()}
    assert set(found) == {"extra", "pride-and-prejudice", "romeo-and-juliet", "saltmere"}
    assert not found["extra"].shipped and not found["romeo-and-juliet"].shipped
    assert books.book_body("extra") == "Hello."
    assert books.read_book("romeo-and-juliet") == "my own copy"


def test_unknown_book_names_the_known_ones(no_books_dir: None) -> None:
    with pytest.raises(books.BookNotFoundError, match="pride-and-prejudice, romeo-and-juliet"):
        books.find_book("moby-dick")


def test_nothing_needs_the_shared_folder() -> None:
    """README, tests, package and CI must work on a clone with nothing beside it."""
    offenders = []
    globs = ("docs/*.md", "s4r/**/*.py", "s4r_cli/*.py", "tests/*.py", "research/*.py")
    for path in [REPO_ROOT / "README.md", REPO_ROOT / "BENCHMARKS.md", REPO_ROOT / ".ci" / "run",
                 *(p for pattern in globs for p in REPO_ROOT.glob(pattern))]:
        if path.name == Path(__file__).name:
            continue
        text = path.read_text(encoding="utf-8")
        # the folder's name spelled in two parts, so this check does not name it itself
        if "shared/data" in text or "../" + "shared" in text or "/work/" in text:
            offenders.append(str(path.relative_to(REPO_ROOT)))
    assert offenders == []


# -- threads ---------------------------------------------------------------------------------------------

def test_auto_threads_leaves_busy_cores_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert auto_threads(cores=2, load=0.1) == 2  # a quiet machine uses its cores
    assert auto_threads(cores=2, load=1.2) == 1  # one busy process: one thread, no spin-waiting
    assert auto_threads(cores=2, load=7.0) == 1  # never fewer than one
    assert auto_threads(cores=16, load=3.6) == 12


def test_a_job_just_started_counts_before_the_load_average_does(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One busy process started seconds ago: the load average still says ~0.2, the CPU use says 1."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    psutil = pytest.importorskip("psutil")
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (0.2, 0.1, 0.0))
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    monkeypatch.setattr(psutil, "cpu_percent", lambda interval=None: 50.0)
    assert threads.busy_cores() == pytest.approx(1.0)
    assert auto_threads() == 1


def test_usable_cores_follow_the_affinity(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under `taskset -c 0,1` on a 16-core machine torch must not start 15 threads on 2 cores."""
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 16)
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert threads.usable_cores() == 2


def test_omp_num_threads_and_explicit_threads_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert auto_threads(cores=8, load=0.0) is None
    assert choose_threads(None) is None
    assert choose_threads(5) == 5
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert choose_threads(None, "cuda") is None  # a GPU run leaves torch alone
    with pytest.raises(ValueError):
        choose_threads(0)
