"""Builds and loads `rows_linear.cpp` (`torch.ops.tsengine_cpu.rows_linear`): a few-row fp32 matmul that reads
each weight once, for decode and verify steps on an AVX2 CPU (3+ rows in AVX-512 where the CPU has it),
from weights stored once as `panels()`. Why it exists and why that layout: the .cpp's header.

Built once per machine by torch's C++ extension loader (a one-off g++ compile; cached by source hash under
torch's extensions directory, so later start-ups load it at once). Where it cannot be built (no
compiler, no AVX2/FMA, another OS), `available()` says so and the engine keeps oneDNN's packed kernel.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger("tsengine")

# above this oneDNN's blocked kernel is faster
# (bench/matmul_rows.py; docs/benchmarks-journal.md, "Compiled step graphs (issue 16)")
MAX_ROWS = 8


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

    if os.environ.get("TSENGINE_ROWS_LINEAR_AVX512", "1") == "0":  # the AVX2 tile only (A/B runs)
        torch.ops.tsengine_cpu.rows_linear_avx512(0)

    @torch.library.register_fake("tsengine_cpu::rows_linear")
    def _(x, panels, out_features, bias, residual):
        return x.new_empty(*x.shape[:-1], out_features)

    @torch.library.register_fake("tsengine_cpu::rows_linear_int8")
    def _(x, panels, scale, bias, residual):
        return x.new_empty(*x.shape[:-1], scale.shape[0])

    return True


PANEL = 16  # output features per panel (the .cpp's P)


def panels(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [N, K] (fp32 or int8) as the kernel reads it: [ceil(N/16), K, 16], panel p holding outputs
    16p..16p+15 k-major, the last one padded with zeros. A copy, made once per weight."""
    n, k = weight.shape
    padded = torch.nn.functional.pad(weight.detach(), (0, 0, 0, -n % PANEL))
    return padded.view(-1, PANEL, k).transpose(1, 2).contiguous()


def avx512(on: bool | None = None) -> bool:
    """Whether 3+ rows take the kernel's AVX-512 tile (the same bits as the AVX2 one, fewer FMAs); `on` sets
    it, never above what the CPU has. The default is on where the CPU reports AVX-512F."""
    return torch.ops.tsengine_cpu.rows_linear_avx512(-1 if on is None else int(on))


def rows_linear(x: torch.Tensor, weight_panels: torch.Tensor, out_features: int, bias: torch.Tensor | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ bias) (+ residual) with W given as `panels(W)` and its out_features."""
    return torch.ops.tsengine_cpu.rows_linear(x, weight_panels, out_features, bias, residual)


def rows_linear_int8(x: torch.Tensor, weight_panels: torch.Tensor, scale: torch.Tensor,
                     bias: torch.Tensor | None = None,
                     residual: torch.Tensor | None = None) -> torch.Tensor:
    """`weight_panels` = panels(q) of int8 q [N, K] with `scale` fp32 [N]:
    y = scale * (x @ q^T) (+ bias) (+ residual)."""
    return torch.ops.tsengine_cpu.rows_linear_int8(x, weight_panels, scale, bias, residual)
