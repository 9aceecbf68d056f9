"""Matmuls for inference: oneDNN pre-packed weights on CPU fp32, plain F.linear elsewhere.

Why: MKL's sgemm on this AMD CPU runs a 4-row verify window at about half the weight bandwidth of one
row (5 vs 11 GB/s; bench/engine_speed.py, docs/benchmarks.md), so verifying S+1 tokens would cost two
decode steps and speculation could never pay. oneDNN's packed kernel (packed once for an 8-row batch)
reads 1, 4 and 8 rows in 27, 33 and 38 ms for all of SmolLM2's weights. On GPU this is plain F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

PACK_ROWS = 8  # oneDNN's batch hint: measured best for 1..8-row inputs (decode and verify windows)


def _packable(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class Linear:
    """y = x W^T (+ b), with the weight packed once when that is faster."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight, self.bias, self.packed = weight, bias, None
        if _packable(weight):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)

    def _fast(self, x: torch.Tensor) -> bool:
        return self.packed is not None and x.dtype == torch.float32 and not torch.is_grad_enabled()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._fast(x):
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if self._fast(x):
            # The residual add rides on the matmul (bitwise equal): one eager op less, ~10 µs on this CPU.
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.packed, self.bias, "add")
        return torch.add(residual, F.linear(x, self.weight, self.bias))


def accelerate(module: nn.Module) -> nn.Module:
    """Give every nn.Linear inside `module` the packed forward, for inference (the engine's copy of the
    draft head; the trainer never calls this). The module's definition and weights are unchanged."""
    for lin in module.modules():
        if isinstance(lin, nn.Linear) and _packable(lin.weight):
            lin.forward = Linear(lin.weight, lin.bias)
    return module
