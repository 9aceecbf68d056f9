"""Multi-turn chat through the server, with and without prefix caching, side by side in one run.

Two `tsengine serve` subprocesses, identical but for `--no-enable-prefix-caching` on one, are up at once
(127.0.0.1, free ports). Each round, every server runs the same `--conversations` chats of `--turns` turns:
each turn resends the whole history (system prompt, earlier questions and the server's own answers) plus a
new question, streamed, greedy. Reported per server: time to first token by turn (median over conversations
and rounds) and the round's wall time (median over rounds). Conversations run `--concurrency` at a time.

Then n > 1: one long prompt asked for n = 1 and for n = `--n` samples (max_tokens 1, so the wall time is
the prefill), `--rounds` times each on every server, each time with a fresh prompt (a nonce at its start:
nothing of it is cached beforehand). Reported: median wall time of n samples / median of one.

Every round starts its chats with its own nonce in the system prompt, so no round reuses another's cache;
the server order is rotated each round. The first round is a warm-up and not recorded (compiled step graphs).

    python bench/multiturn.py [--draft DIR [--adaptive]] [--conversations 8 --turns 4 --max-tokens 64 --rounds 3
        --concurrency 1 --n 4 --json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_speed import val_prompts_text  # noqa: E402
from serve_throughput import free_port, stop_servers, wait_healthy  # noqa: E402

MODEL = "bench"
FOLLOW_UPS = ["Can you explain that in more detail?", "Give a concrete example.",
              "Summarize everything so far in two sentences.", "What would you add?"]


def start_server(args, name: str, extra: list[str]) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "tsengine.entrypoints.cli", "serve", "--model", args.target, "--port", str(port),
           "--served-model-name", MODEL, "--max-num-seqs", str(max(args.concurrency, args.n)),
           "--kv-cache-memory", str(args.kv_cache_memory), *extra]
    if args.draft:
        cmd += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", args.draft,
                "--speculative-num-steps", str(args.steps)] + ([] if args.adaptive else ["--no-speculative-adaptive"])
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env=os.environ.copy())
    return {"name": name, "proc": proc, "base": f"http://127.0.0.1:{port}", "cmd": cmd, "log": log}


async def chat_turn(client: httpx.AsyncClient, base: str, messages: list[dict], max_tokens: int) -> tuple[float, str]:
    """(seconds to the first content token, the answer), streamed."""
    t0, first, text = time.perf_counter(), None, []
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"].get("content")
            if delta:
                first = first or time.perf_counter() - t0
                text.append(delta)
    return first if first is not None else time.perf_counter() - t0, "".join(text)


async def conversations(args, base: str, questions: list[str], nonce: str) -> tuple[list[list[float]], float]:
    """Every conversation's TTFT per turn, and the wall time of all of them."""
    sem = asyncio.Semaphore(args.concurrency)

    async def one(client, question):
        messages = [{"role": "system", "content": f"Session {nonce}. You are a concise, helpful assistant."},
                    {"role": "user", "content": question}]
        ttfts = []
        async with sem:
            for turn in range(args.turns):
                ttft, answer = await chat_turn(client, base, messages, args.max_tokens)
                ttfts.append(ttft)
                messages += [{"role": "assistant", "content": answer},
                             {"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)]}]
        return ttfts

    async with httpx.AsyncClient(timeout=3600) as client:
        t0 = time.perf_counter()
        ttfts = await asyncio.gather(*(one(client, q) for q in questions))
        return list(ttfts), time.perf_counter() - t0


def long_prompt(nonce: str, words: int) -> str:
    text = " ".join(val_prompts_text(64))
    return f"[{nonce}] " + " ".join(text.split()[:words]) + "\nSummarize the text above."


def n_samples_wall(base: str, prompt: str, n: int) -> float:
    t0 = time.perf_counter()
    r = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1, "n": n,
                                                   "temperature": 0.8, "seed": 1}, timeout=600)
    r.raise_for_status()
    assert len(r.json()["choices"]) == n
    return time.perf_counter() - t0


def prefix_metrics(base: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line.startswith("tsengine:prefix_cache_"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft", help="EAGLE-3 head for both servers (default: plain decoding)")
    ap.add_argument("--steps", type=int, default=3, help="EAGLE-3 chain length (with --draft)")
    ap.add_argument("--adaptive", action="store_true", help="with --draft: the default adaptive speculation "
                    "(--steps its longest chain), not a chain pinned at --steps")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=1, help="conversations at once")
    ap.add_argument("--rounds", type=int, default=3, help="recorded rounds (after one warm-up round)")
    ap.add_argument("--n", type=int, default=4, help="samples for the n > 1 prefill measurement")
    ap.add_argument("--n-words", type=int, default=600, help="words of the n > 1 prompt")
    ap.add_argument("--kv-cache-memory", type=int, default=2 * 10**9)
    ap.add_argument("--json", help="write every measurement and the medians here")
    args = ap.parse_args()
    questions = val_prompts_text(args.conversations)
    servers = [start_server(args, "prefix cache", []), start_server(args, "no cache", ["--no-enable-prefix-caching"])]
    raw = {s["name"]: {"ttft": [], "wall": [], "n1": [], "nN": []} for s in servers}
    try:
        wait_healthy(servers)
        for r in range(args.rounds + 1):
            k = r % len(servers)
            for s in servers[k:] + servers[:k]:
                ttfts, wall = asyncio.run(conversations(args, s["base"], questions, f"{r}-{s['name']}"))
                one = n_samples_wall(s["base"], long_prompt(f"{r}-{s['name']}-1", args.n_words), 1)
                many = n_samples_wall(s["base"], long_prompt(f"{r}-{s['name']}-{args.n}", args.n_words), args.n)
                print(f"round {r}{' (warm-up)' if r == 0 else ''} {s['name']}: wall {wall:.1f} s, TTFT by turn "
                      + " ".join(f"{statistics.median(t[i] for t in ttfts) * 1000:.0f}" for i in range(args.turns))
                      + f" ms; n=1 {one:.2f} s, n={args.n} {many:.2f} s", flush=True)
                if r:
                    raw[s["name"]]["ttft"] += ttfts
                    raw[s["name"]]["wall"].append(wall)
                    raw[s["name"]]["n1"].append(one)
                    raw[s["name"]]["nN"].append(many)
        metrics = prefix_metrics(servers[0]["base"])
    finally:
        stop_servers(servers)
    med = {}
    print(f"\nmedians over {args.rounds} rounds ({args.conversations} conversations x {args.turns} turns, "
          f"concurrency {args.concurrency}, max_tokens {args.max_tokens})\n")
    print("| server | " + " | ".join(f"TTFT turn {i + 1} (ms)" for i in range(args.turns))
          + f" | wall per round (s) | n=1 prefill (s) | n={args.n} (s) | n={args.n} / n=1 |")
    print("| --- |" + " --- |" * (args.turns + 4))
    for name, m in raw.items():
        by_turn = [statistics.median(t[i] for t in m["ttft"]) for i in range(args.turns)]
        n1, nn = statistics.median(m["n1"]), statistics.median(m["nN"])
        med[name] = {"ttft_ms": [x * 1000 for x in by_turn], "wall_s": statistics.median(m["wall"]),
                     "n1_s": n1, "nN_s": nn}
        print(f"| {name} | " + " | ".join(f"{x * 1000:.0f}" for x in by_turn)
              + f" | {med[name]['wall_s']:.1f} | {n1:.2f} | {nn:.2f} | {nn / n1:.2f}x |")
    on, off = med["prefix cache"], med["no cache"]
    print("\nTTFT without / with the cache, by turn: "
          + " ".join(f"{b / a:.2f}x" for a, b in zip(on["ttft_ms"], off["ttft_ms"])))
    print(f"wall without / with: {off['wall_s'] / on['wall_s']:.2f}x; prefix cache counters: {metrics}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "raw": raw, "medians": med, "metrics": metrics}, f, indent=1)


if __name__ == "__main__":
    main()
