"""Server throughput at several concurrency levels: plain, fixed EAGLE-3 chains, and adaptive speculation.

Starts `tsengine serve` as a subprocess (127.0.0.1, a free port), waits for /health, then for each
concurrency c sends c streams of completions at once, `--requests-per-level` in total, greedy,
`--max-tokens` each with EOS ignored (every request decodes the same count), and reports output
tokens/s over the level's wall time plus τ from the usage fields.

    python bench/serve_throughput.py --draft DIR [--levels 1,4,16 --max-tokens 128 --chains 1,3 --png FILE]

Servers run one after another, each over every level, so rows of one run compare side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time

import httpx

MODEL = "smollm2-135m"  # the served model name (set from --target in main)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def level(base: str, prompts: list[str], conc: int, total: int, max_tokens: int) -> dict:
    sem = asyncio.Semaphore(conc)
    tokens = steps = 0

    async def one(client, i):
        nonlocal tokens, steps
        async with sem:
            r = await client.post(f"{base}/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": prompts[i % len(prompts)]}],
                "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
            r.raise_for_status()
            u = r.json()["usage"]
            tokens += u["completion_tokens"]
            steps += u.get("spec_verify_steps", 0)

    async with httpx.AsyncClient(timeout=3600) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(client, i) for i in range(total)))
        dt = time.perf_counter() - t0
    return {"tok_s": tokens / dt, "tau": (tokens - total) / steps if steps else None, "wall": dt}


def run_server(args, spec: list[str]):
    port = free_port()
    cmd = [sys.executable, "-m", "tsengine.cli", "serve", "--model", args.target, "--port", str(port),
           "--max-num-seqs", str(max(args.levels)), *spec]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=os.environ.copy())
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"server exited: {' '.join(cmd)}")
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("server did not come up")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft")
    ap.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16])
    ap.add_argument("--requests-per-level", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--chains", type=lambda s: [int(x) for x in s.split(",")], default=[3],
                    help="fixed chain lengths to measure (with --draft)")
    ap.add_argument("--no-adaptive", action="store_true", help="skip the adaptive server (with --draft)")
    ap.add_argument("--png", help="plot output tok/s per concurrency here")
    args = ap.parse_args()
    global MODEL
    MODEL = args.target
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from engine_speed import val_prompts_text

    prompts = val_prompts_text(16)
    rows = [("plain", [])]
    if args.draft:
        eagle = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", args.draft]
        rows += [(f"eagle3 chain {k}", [*eagle, "--speculative-num-steps", str(k)]) for k in args.chains]
        if not args.no_adaptive:
            rows.append((f"adaptive (0..{max(args.chains)})",
                         [*eagle, "--speculative-num-steps", str(max(args.chains)), "--speculative-adaptive"]))
    results: dict[str, dict[int, float]] = {}
    print("| server | concurrency | output tok/s | τ | wall s |")
    print("| --- | --- | --- | --- | --- |")
    for name, spec in rows:
        proc, base = run_server(args, spec)
        try:
            asyncio.run(level(base, prompts, 1, 1, 8))  # warm-up
            for c in args.levels:
                n = max(c, args.requests_per_level if c > 1 else max(2, args.requests_per_level // 4))
                r = asyncio.run(level(base, prompts, c, n, args.max_tokens))
                tau = f"{r['tau']:.2f}" if r["tau"] else "-"
                print(f"| {name} | {c} | {r['tok_s']:.1f} | {tau} | {r['wall']:.1f} |", flush=True)
                results.setdefault(name, {})[c] = r["tok_s"]
        finally:
            proc.terminate()
            proc.wait()
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for name, by_level in results.items():
            ax.plot(list(by_level), list(by_level.values()), marker="o", label=name)
        ax.set(xscale="log", xlabel="concurrency", ylabel="output tok/s", title=f"{args.target} server throughput")
        ax.set_xticks(args.levels, [str(c) for c in args.levels])
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.png, dpi=120)


if __name__ == "__main__":
    main()
