"""Fused decode kernels, on a CPU (numba) and on a GPU (Triton: `triton_step`), each beside the plain PyTorch
code that stays its reference.

`numba` brings its own compiler (LLVM inside the llvmlite wheel), so a plain `pip install` on a machine
without a C compiler still compiles these kernels at first use; compiled code is cached on disk
(`cache=True`). Where numba is missing or fails, one line is logged and the eager path runs.
Triton comes with a CUDA build of torch and is imported only where its kernels may run. `S4RConfig.kernels`
picks the path: "auto" (fused where supported), "eager", or "fused".
"""
