"""What one decode / verify step's matmuls cost on this CPU: every weight of a Llama-shaped target, read
once for 1, 4 and 8 input rows, with torch's default F.linear (MKL) and with oneDNN pre-packed weights
(`tsengine/linear.py`). Random weights of the real shapes (default SmolLM2-135M); min over repeats.

    python bench/matmul_rows.py [--hidden 576 --inter 1536 --layers 30 --heads 9 --kv-heads 3 --vocab 49152]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from tsengine.linear import PACK_ROWS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, v in [("hidden", 576), ("inter", 1536), ("layers", 30), ("heads", 9), ("kv-heads", 3), ("vocab", 49152),
                    ("repeats", 8)]:
        ap.add_argument(f"--{name}", type=int, default=v)
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    d = a.hidden // a.heads
    shapes = [((a.heads + 2 * a.kv_heads) * d, a.hidden), (a.hidden, a.heads * d), (2 * a.inter, a.hidden),
              (a.hidden, a.inter)] * a.layers + [(a.vocab, a.hidden)]
    ws = [torch.randn(s) for s in shapes]
    mb = sum(w.numel() * 4 for w in ws) / 1e6
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS) for w in ws]
    lp = torch.ops.mkldnn._linear_pointwise
    print(f"{mb:.0f} MB of fp32 weights, torch threads {torch.get_num_threads()}")
    print("| rows | F.linear (MKL) ms | GB/s | oneDNN packed ms | GB/s |")
    print("| --- | --- | --- | --- | --- |")
    for m in (1, 4, 8):
        xs = {w.shape[1]: torch.randn(m, w.shape[1]) for w in ws}
        best = [1e9, 1e9]
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            for w in ws:
                F.linear(xs[w.shape[1]], w)
            t1 = time.perf_counter()
            for w, p in zip(ws, packed):
                lp(xs[w.shape[1]], p, None, "none", [], "")
            t2 = time.perf_counter()
            best = [min(best[0], t1 - t0), min(best[1], t2 - t1)]
        print(f"| {m} | {best[0] * 1e3:.1f} | {mb / 1e3 / best[0]:.1f} | {best[1] * 1e3:.1f} | {mb / 1e3 / best[1]:.1f} |")


if __name__ == "__main__":
    main()
