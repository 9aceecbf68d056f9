"""Where one decode forward's time goes, piece by piece inside the real layer loop (batch 1, 1 token).

Each piece of every layer is timed with perf_counter around the same calls `Layer.forward` makes (the CPU
is synchronous, so the wall time of a piece is its cost, dispatch included), summed over `--forwards`
forwards of one token at position `--position`:

    python bench/layer_split.py [--target smollm2-135m --forwards 100 --position 100] [--thread] [--compiled
        [--rows 1,4]]

`--compiled` profiles the compiled step graph instead (tsengine/model/graphs.py): the pieces are fused there, so
it lists torch profiler's ops (the matmuls, inductor's fused C++ kernels) per forward, and the wall time;
`--rows` times a verify window of each row count too (one graph each, rounds alternating in one process),
and prints each one's wall time against the first's (issue 16's "4-row verify ≤ 1.1× a 1-row decode"),
and each one's profile beside the first's.

`--thread` runs the loop on a second thread while the main thread keeps the pool it loaded the model
with (the OpenMP pool effect in docs/benchmarks-journal.md, "Server throughput (issue 4)").
"""

from __future__ import annotations

import argparse
import collections
import threading
import time

import torch
import torch.nn.functional as F


def main() -> None:
    from tsengine.entrypoints.llm import LLM
    from tsengine.model.attention import paged_attention, write_kv
    from tsengine.model.context import Context
    from tsengine.model.llama import rms_norm, rope_matrices
    from tsengine.targets import resolve

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--forwards", type=int, default=100)
    ap.add_argument("--position", type=int, default=100)
    ap.add_argument("--thread", action="store_true")
    ap.add_argument("--compiled", action="store_true")
    ap.add_argument("--rows", default="1", help="with --compiled: rows per step to time, comma-separated (1: a "
                    "decode step; more: a verify window), e.g. 1,4")
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
    import statistics

    from torch.profiler import ProfilerActivity, profile

    from tsengine.entrypoints.llm import LLM
    from tsengine.model.context import Context
    from tsengine.targets import resolve

    r = LLM(resolve(a.target), max_num_seqs=1, enforce_eager=False).engine.runner
    table = list(range(-(-(a.position + 16) // r.block_size)))

    def step(rows: int):
        ids = torch.full((rows,), 1000)
        run = _Run(rows)

        def forward():
            ctx = Context.build([(table, a.position, rows)], r.block_size, "cpu")
            return r.compiled.forward(r.compiled.shape_for([run], ctx, False), ids, ctx)
        return forward

    steps = {n: step(n) for n in (int(x) for x in a.rows.split(","))}
    for forward in steps.values():
        forward()  # compiles (or loads) the graph
    walls: dict[int, list[float]] = {n: [] for n in steps}
    for _ in range(5):  # rounds alternating between the row counts: machine drift hits each alike
        for n, forward in steps.items():
            t0 = time.perf_counter()
            for _ in range(max(1, a.forwards // 5)):
                forward()
            walls[n].append((time.perf_counter() - t0) / max(1, a.forwards // 5))
    first = next(iter(steps))
    per_op: dict[int, dict[str, tuple[float, float]]] = {}  # rows -> op -> (calls, ms) per forward
    for n, forward in steps.items():  # each row count's own profile: where its extra time over 1 row goes
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(a.forwards):
                forward()
        per_op[n] = {_op_name(e.key): (e.count / a.forwards, e.self_cpu_time_total / a.forwards / 1e3)
                     for e in prof.key_averages()}
    top = sorted(per_op[first], key=lambda k: -per_op[first][k][1])[:14]
    print("| op (compiled graph, self time) | calls per forward | "
          + " | ".join(f"ms, {n} row(s)" for n in steps) + " |\n|" + " --- |" * (2 + len(steps)))
    for key in top:
        ms = " | ".join(f"{per_op[n].get(key, (0, 0.0))[1]:.2f}" for n in steps)
        print(f"| {key[:60]} | {per_op[first][key][0]:.0f} | {ms} |")
    base = statistics.median(walls[first])
    print("\n| rows per step | wall ms per forward (median of 5 rounds) | vs the first |\n| --- | --- | --- |")
    for n, w in walls.items():
        print(f"| {n} | {statistics.median(w) * 1e3:.2f} | {statistics.median(w) / base:.2f}x |")


def _op_name(key: str) -> str:
    """A graph's profiler entries named alike whatever its shape (hash and region ids dropped): the rows
    of different row counts then line up."""
    import re

    return re.sub(r"CompiledFxGraph \w+", "CompiledFxGraph", re.sub(r"Region: \d+/\d+", "Region", key))


class _Run:
    """A decode run (1 row) or a chain verify window (more), as `CompiledSteps.shape_for` reads it."""

    seq = type("Seq", (), {"capture": None})()

    def __init__(self, rows: int):
        self.num_tokens, self.verify = rows, rows > 1


if __name__ == "__main__":
    main()
