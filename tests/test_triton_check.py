"""`research.triton_check`, the prepared GPU check of the Triton kernels, run through the interpreter."""

from __future__ import annotations

import torch


def test_the_gpu_check_compares_both_kernels_through_the_interpreter(triton_interpreted, capsys):
    """On a CPU with TRITON_INTERPRET=1 the script compares both kernels with the eager path and finds
    them close; asked for a GPU that is not there, it says so in one line (exit 2)."""
    from research import triton_check

    if not torch.cuda.is_available():
        assert triton_check.main(["--device", "cuda"]) == 2
    code = triton_check.main(["--device", "cpu", "--tokens", "400", "--kv-heads", "2", "--repeats", "1"])
    out = capsys.readouterr().out
    gaps = [float(line.split("max difference ")[1].split()[0]) for line in out.splitlines()
            if "max difference" in line]
    assert code == 0 and len(gaps) == 2 and max(gaps) < 1e-3, out
