"""Where one decode forward's time goes, piece by piece inside the real layer loop (batch 1, 1 token).

Each piece of every layer is timed with perf_counter around the same calls `Layer.forward` makes (the CPU
is synchronous, so the wall time of a piece is its cost, dispatch included), summed over `--forwards`
forwards of one token at position `--position`:

    python bench/layer_split.py [--target smollm2-135m --forwards 100 --position 100] [--thread] [--compiled]

`--compiled` profiles the compiled step graph instead (tsengine/graphs.py): the pieces are fused there, so
it lists torch profiler's ops (the matmuls, inductor's fused C++ kernels) per forward, and the wall time.

`--thread` runs the loop on a second thread while the main thread keeps the pool it loaded the model
with (the OpenMP pool effect in docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import collections
import threading
import time

import torch
import torch.nn.functional as F


def main() -> None:
    from tsengine.attention import paged_attention, write_kv
    from tsengine.context import Context
    from tsengine.llm import LLM
    from tsengine.models.llama import rms_norm, rope_matrices
    from tsengine.targets import resolve

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--forwards", type=int, default=100)
    ap.add_argument("--position", type=int, default=100)
    ap.add_argument("--thread", action="store_true")
    ap.add_argument("--compiled", action="store_true")
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    if a.compiled:
        return compiled_profile(a)
    r = LLM(resolve(a.target), max_num_seqs=1, enforce_eager=True).engine.runner
    m, bs = r.model, r.block_size
    table = list(range(-(-(a.position + 1) // bs)))
    acc: dict[str, float] = collections.defaultdict(float)

    def lap(name: str, t0: float) -> float:
        t = time.perf_counter()
        acc[name] += t - t0
        return t

    def loop() -> None:
        torch.set_grad_enabled(False)
        for _ in range(a.forwards):
            ctx = Context.build([(table, a.position, 1)], bs, "cpu")
            rope = rope_matrices(m._cos[ctx.positions], m._sin[ctx.positions])
            x = torch.randn(1, m.cfg.hidden_size)
            for i, L in enumerate(m.layers):
                kv, f, w = r.kv[i], L.fast, (L.nh + L.nkv) * L.d
                t = time.perf_counter()
                h = rms_norm(x, L.ln1, L.eps); t = lap("input RMSNorm", t)
                qkv = f["qkv"](h); t = lap("qkv matmul", t)
                qk, v = qkv[:, :w].view(1, L.nh + L.nkv, L.d), qkv[:, w:].view(1, L.nkv, L.d); t = lap("views", t)
                qk = torch.bmm(qk, rope); t = lap("RoPE", t)
                write_kv(kv[0], kv[1], qk[:, L.nh:], v, ctx); t = lap("KV write", t)
                o = paged_attention(qk[:, :L.nh], kv[0], kv[1], ctx, L.d ** -0.5, r.backend); t = lap("attention", t)
                x = f["o"].add(o.reshape(1, -1), x); t = lap("o matmul + residual", t)
                h = rms_norm(x, L.ln2, L.eps); t = lap("post-attn RMSNorm", t)
                gu = f["gate_up"](h); t = lap("gate_up matmul", t)
                g, u = gu.chunk(2, dim=-1)
                u = F.silu(g) * u; t = lap("SiLU * up", t)
                x = f["down"].add(u, x); t = lap("down matmul + residual", t)
            t = time.perf_counter()
            m.logits(x); lap("LM head", t)

    if a.thread:
        th = threading.Thread(target=loop)
        th.start()
        th.join()
    else:
        loop()
    layers = a.forwards * len(m.layers)
    print("| piece | µs per layer | ms per forward |\n| --- | --- | --- |")
    for name, v in acc.items():
        per_layer = f"{v / layers * 1e6:.1f}" if name != "LM head" else "-"
        print(f"| {name} | {per_layer} | {v / a.forwards * 1e3:.2f} |")
    print(f"| total | | {sum(acc.values()) / a.forwards * 1e3:.2f} |")


def compiled_profile(a) -> None:
    from torch.profiler import ProfilerActivity, profile

    from tsengine.context import Context
    from tsengine.graphs import Shape
    from tsengine.llm import LLM
    from tsengine.targets import resolve

    r = LLM(resolve(a.target), max_num_seqs=1, enforce_eager=False).engine.runner
    table = list(range(-(-(a.position + 1) // r.block_size)))
    ids = torch.tensor([1000])

    def forward():
        ctx = Context.build([(table, a.position, 1)], r.block_size, "cpu")
        return r.compiled.forward(r.compiled.shape_for([_Run()], ctx, False), ids, ctx)

    forward()  # compiles (or loads) the graph
    t0 = time.perf_counter()
    for _ in range(a.forwards):
        forward()
    wall = (time.perf_counter() - t0) / a.forwards
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(a.forwards):
            forward()
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:14]
    print("| op (compiled graph, self time) | calls per forward | ms per forward |\n| --- | --- | --- |")
    for e in rows:
        print(f"| {e.key[:60]} | {e.count / a.forwards:.0f} | {e.self_cpu_time_total / a.forwards / 1e3:.2f} |")
    print(f"| wall time per forward (unprofiled) | | {wall * 1e3:.2f} |")


class _Run:
    """A one-token decode run, as `CompiledSteps.shape_for` reads it."""

    num_tokens, verify = 1, False
    seq = type("Seq", (), {"capture": None})()


if __name__ == "__main__":
    main()
