"""What one decode / verify step's matmuls cost on this CPU: every weight of a Llama-shaped target, read
once for 1 to 16 input rows, with torch's default F.linear (MKL), with oneDNN pre-packed weights and with
our few-row kernel (`tsengine/model/kernels/rows_linear.cpp`; `tsengine/model/linear.py` picks between them;
on an AVX-512 CPU also with its AVX2 tile alone), and that kernel on int8 weights (what the draft head can
run; GB/s there counts the fp32 bytes it stands for). Random weights of the real shapes (default
SmolLM2-135M); min over repeats, the kernels interleaved per repeat.

    python bench/matmul_rows.py [--rows 1,2,4,8,16 --hidden 576 --inter 1536 --layers 30 --heads 9 --kv-heads 3
        --vocab 49152]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from tsengine.model.kernels import rows_linear
from tsengine.model.linear import PACK_ROWS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, v in [("hidden", 576), ("inter", 1536), ("layers", 30), ("heads", 9), ("kv-heads", 3), ("vocab", 49152),
                    ("repeats", 8)]:
        ap.add_argument(f"--{name}", type=int, default=v)
    ap.add_argument("--rows", default="1,2,4,8,16", help="input rows to measure, comma-separated")
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    d = a.hidden // a.heads
    shapes = [((a.heads + 2 * a.kv_heads) * d, a.hidden), (a.hidden, a.heads * d), (2 * a.inter, a.hidden),
              (a.hidden, a.inter)] * a.layers + [(a.vocab, a.hidden)]
    ws = [torch.randn(s) for s in shapes]
    mb = sum(w.numel() * 4 for w in ws) / 1e6
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS) for w in ws]
    lp = torch.ops.mkldnn._linear_pointwise
    kernels = {"F.linear (MKL)": lambda x, w, p: F.linear(x, w),
               "oneDNN packed": lambda x, w, p: lp(x, p, None, "none", [], "")}
    if rows_linear.available():
        from tsengine.model.linear import quantize_int8

        panels = {id(w): rows_linear.panels(w) for w in ws}
        kernels["rows_linear"] = lambda x, w, p: rows_linear.rows_linear(x, panels[id(w)], w.shape[0])
        if rows_linear.avx512():  # the same kernel with 3+ rows in AVX2, side by side (the same bits)
            def avx2(x, w, p):
                rows_linear.avx512(False)
                try:
                    return rows_linear.rows_linear(x, panels[id(w)], w.shape[0])
                finally:
                    rows_linear.avx512(True)

            kernels["rows_linear, AVX2 only"] = avx2
        int8 = {id(w): quantize_int8(w) for w in ws}  # GB/s below counts fp32 bytes: int8 reads a quarter
        int8 = {k: (rows_linear.panels(q), scale) for k, (q, scale) in int8.items()}
        kernels["rows_linear int8"] = lambda x, w, p: rows_linear.rows_linear_int8(x, *int8[id(w)])
    print(f"{mb:.0f} MB of fp32 weights, torch threads {torch.get_num_threads()}")
    print("| rows | " + " | ".join(f"{k} ms | GB/s" for k in kernels) + " |")
    print("| --- |" + " --- | --- |" * len(kernels))
    for m in (int(r) for r in a.rows.split(",")):
        xs = {w.shape[1]: torch.randn(m, w.shape[1]) for w in ws}
        best = dict.fromkeys(kernels, 1e9)
        for _ in range(a.repeats):
            for name, kernel in kernels.items():
                t0 = time.perf_counter()
                for w, p in zip(ws, packed):
                    kernel(xs[w.shape[1]], w, p)
                best[name] = min(best[name], time.perf_counter() - t0)
        print(f"| {m} | " + " | ".join(f"{t * 1e3:.1f} | {mb / 1e3 / t:.1f}" for t in best.values()) + " |", flush=True)

if __name__ == "__main__":
    main()
