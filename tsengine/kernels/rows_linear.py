"""Builds and loads `rows_linear.cpp` (`torch.ops.tsengine_cpu.rows_linear`): a few-row fp32 matmul that reads
each weight once, for decode and verify steps on an AVX2 CPU. Why it exists: the .cpp's header.

Built once per machine by torch's C++ extension loader (~30 s with g++; cached by source hash under
torch's extensions directory, so later start-ups load it in milliseconds). Where it cannot be built (no
compiler, no AVX2/FMA, another OS), `available()` says so and the engine keeps oneDNN's packed kernel.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger("tsengine")

MAX_ROWS = 8  # above this oneDNN's blocked kernel is faster (12 rows: 37.6 vs 34.4 ms for SmolLM2, bench/matmul_rows.py)


def _cpu_has_avx2() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx2" in flags and " fma" in flags


@functools.cache
def available() -> bool:
    """Whether the op is loaded (building it on first use); logs why not, once."""
    if os.environ.get("TSENGINE_ROWS_LINEAR", "1") == "0":
        return False
    if not _cpu_has_avx2():
        return False
    try:
        from torch.utils.cpp_extension import load

        load(name="tsengine_rows_linear", sources=[str(Path(__file__).with_suffix(".cpp"))],
             extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"], is_python_module=False, verbose=False)
    except Exception as error:  # no compiler, headers or toolchain: the packed kernel serves instead
        log.warning("rows_linear kernel unavailable (%s); using oneDNN's packed matmuls", str(error).splitlines()[0])
        return False

    @torch.library.register_fake("tsengine_cpu::rows_linear")
    def _(x, weight, bias, residual):
        return x.new_empty(*x.shape[:-1], weight.shape[0])

    @torch.library.register_fake("tsengine_cpu::rows_linear_int8")
    def _(x, weight, scale, bias, residual):
        return x.new_empty(*x.shape[:-1], weight.shape[0])

    return True


def rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.tsengine_cpu.rows_linear(x, weight, bias, residual)


def rows_linear_int8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                     residual: torch.Tensor | None = None) -> torch.Tensor:
    """`weight` int8 [N, K] with `scale` fp32 [N]: y = scale * (x @ weight^T) (+ bias) (+ residual)."""
    return torch.ops.tsengine_cpu.rows_linear_int8(x, weight, scale, bias, residual)
