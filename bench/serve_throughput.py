"""Server throughput at several concurrency levels: plain, fixed EAGLE-3 chains/trees, NGRAM and adaptive.

Starts one `tsengine serve` subprocess per row (127.0.0.1, free ports) up front and waits for every
/health. At each concurrency c a row sends c streams of completions at once, `--requests-per-level` in
total, greedy, `--max-tokens` each with EOS ignored (every request decodes the same count), and reports
output tokens/s over the level's wall time plus τ from the usage fields.

    python bench/serve_throughput.py --draft DIR [--levels 1,4,16 --max-tokens 128 --chains 1,3
        --trees 5x8x32,3x2x6 --ngram --adaptive-flags "..." --rounds 3 --json FILE --png FILE]

Method: rows measured one server after another, minutes apart, varied by ±15% between runs, so noise
decided comparisons. Now all servers are up together (idle ones run no engine loop), and every level is
measured in `--rounds` rounds; in each round every server runs the level once, in an order rotated by the
round (no server always goes first). The summary reports per server and level the median over rounds,
the min–max, the ratio to plain and, with an adaptive row, adaptive vs the best fixed row.

Resolution: identical servers do not run alike. On a 2-core AMD Zen 3, plain servers with the same flags ran
3-4% apart in the median of 5 rounds in one run and 11% in another, with single rounds 25-30% low
(docs/benchmarks.md, "Eleventh run" and "Twelfth run"). Run with `--plain-replicas 2` or more to print that
spread beside the verdict of each level: a margin inside it decides nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

MODEL = "bench"  # the served model name (every server gets --served-model-name MODEL)
FORCED_PLAIN = "adaptive, forced plain"  # the row bench/forced_plain_server.py serves


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def int_list(s: str) -> list[int]:
    return [int(x) for x in s.split(",")]


def tree_list(s: str) -> list[tuple[int, ...]]:  # "5x8x32,3x2x6" -> [(5, 8, 32), (3, 2, 6)]
    return [tuple(int(x) for x in part.lower().split("x")) for part in s.split(",") if part]


async def level(base: str, prompts: list[str], conc: int, total: int, max_tokens: int) -> dict:
    sem = asyncio.Semaphore(conc)
    tokens = steps = accepted = 0

    async def one(client, i):
        nonlocal tokens, steps, accepted
        async with sem:
            r = await client.post(f"{base}/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": prompts[i % len(prompts)]}],
                "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
            r.raise_for_status()
            u = r.json()["usage"]
            tokens += u["completion_tokens"]
            steps += u.get("spec_verify_steps", 0)
            accepted += u.get("spec_accepted_tokens", 0)

    async with httpx.AsyncClient(timeout=3600) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(client, i) for i in range(total)))
        dt = time.perf_counter() - t0
    # τ over verify steps only (adaptive and NGRAM rows also decode plainly): tokens per verify forward
    return {"tok_s": tokens / dt, "tau": 1 + accepted / steps if steps else None, "wall": dt}


def server_rows(args) -> list[tuple[str, list[str]]]:
    rows = [("plain", [])] + [(f"plain #{i}", []) for i in range(2, args.plain_replicas + 1)]
    if args.ngram:
        rows.append((f"ngram {max(args.chains)}",
                     ["--speculative-algorithm", "NGRAM", "--speculative-num-steps", str(max(args.chains))]))
    if args.draft:
        eagle = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", args.draft]
        pinned = [*eagle, "--no-speculative-adaptive"]  # a fixed shape; adaptive is the default
        rows += [(f"eagle3 chain {k}", [*pinned, "--speculative-num-steps", str(k)]) for k in args.chains]
        rows += [(f"eagle3 tree {s}x{k}x{n}", [*pinned, "--speculative-num-steps", str(s),
                  "--speculative-eagle-topk", str(k), "--speculative-num-draft-tokens", str(n)])
                 for s, k, n in args.trees]
        if not args.no_adaptive:  # the default server: no flag
            mode = ["--speculative-config", args.adaptive_config] if args.adaptive_config else []
            rows.append((f"adaptive (0..{max(args.chains)})", [*eagle, "--speculative-num-steps",
                         str(max(args.chains)), *mode, *shlex.split(args.adaptive_flags)]))
        if args.forced_plain:  # bench/forced_plain_server.py: the adaptive server, always deciding plain
            rows.append((FORCED_PLAIN, [*eagle, "--speculative-num-steps", str(max(args.chains))]))
    return rows


def start_server(args, name: str, spec: list[str]) -> dict:
    port = free_port()
    forced = os.path.join(os.path.dirname(os.path.abspath(__file__)), "forced_plain_server.py")
    entry = [forced] if name == FORCED_PLAIN else ["-m", "tsengine.entrypoints.cli"]
    cmd = [sys.executable, *entry, "serve", "--model", args.target, "--port", str(port),
           "--served-model-name", MODEL, "--max-num-seqs", str(max(args.levels)),
           # every server is up at once, so each gets a bounded KV cache (the default sizes it for the whole
           # context of every request: ~4 GiB for SmolLM2 at 64 requests, five of which exhaust 24 GiB)
           "--kv-cache-memory", str(args.kv_cache_memory), *spec]
    log = tempfile.TemporaryFile()  # stderr, shown if the server dies before it is healthy
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env=os.environ.copy())
    return {"proc": proc, "base": f"http://127.0.0.1:{port}", "cmd": cmd, "log": log}


def wait_healthy(servers: list[dict], timeout_s: float = 600) -> None:
    pending, deadline = list(servers), time.monotonic() + timeout_s
    while pending:
        for s in list(pending):
            try:
                if httpx.get(f"{s['base']}/health", timeout=1).status_code == 200:
                    pending.remove(s)
                    continue
            except httpx.HTTPError:
                pass
            if s["proc"].poll() is not None:
                s["log"].seek(0)
                tail = s["log"].read().decode(errors="replace")[-2000:]
                raise SystemExit(f"server exited: {shlex.join(s['cmd'])}\n{tail}")
        if time.monotonic() > deadline:
            raise SystemExit("servers did not come up: " + ", ".join(s["name"] for s in pending))
        time.sleep(0.5)


def stop_servers(servers: list[dict]) -> None:
    for s in servers:
        if s["proc"].poll() is None:
            s["proc"].terminate()
    for s in servers:
        try:
            s["proc"].wait(timeout=10)
        except subprocess.TimeoutExpired:
            s["proc"].kill()
            s["proc"].wait()


def metrics(base: str) -> list[str]:
    return httpx.get(f"{base}/metrics", timeout=10).text.splitlines()


def policy_counts(base: str) -> dict[str, float]:
    """An adaptive server's cumulative choices from /metrics (steps per choice, request-steps per source)."""
    out = {}
    for line in metrics(base):
        if line.startswith(("tsengine:spec_decode_policy_steps_total{", "tsengine:spec_decode_policy_requests_total{")):
            key, value = line.rsplit(" ", 1)
            out[key.split("{", 1)[1].rstrip("}").replace('"', "")] = float(value)
    return out


def policy_beliefs(base: str) -> dict[str, float]:
    """An adaptive server's priced step and head times per arm and batch bucket, and its prediction ratios
    (/metrics): why it chose what it did."""
    names = ("tsengine:spec_decode_step_seconds{", "tsengine:spec_decode_head_seconds{",
             "tsengine:spec_decode_prediction_ratio{", "tsengine:spec_decode_refill_share ")
    return {line.rsplit(" ", 1)[0].removeprefix("tsengine:spec_decode_"): float(line.rsplit(" ", 1)[1])
            for line in metrics(base) if line.startswith(names)}


def compiled_graphs(base: str) -> float:
    """How many step graphs the server has compiled so far (/metrics), after waiting (up to 15 min) for
    those still compiling off its engine thread."""
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        values = {line.split()[0]: float(line.split()[1]) for line in metrics(base)
                  if line.startswith(("tsengine:compiled_graphs_total ", "tsengine:compiling_graphs "))}
        if not values.get("tsengine:compiling_graphs"):
            return values.get("tsengine:compiled_graphs_total", 0.0)
        time.sleep(1)
    raise SystemExit(f"{base}: graphs still compiling after 15 minutes")


def warm_up(args, s: dict, prompts: list[str]) -> None:
    """Every level as measured, unrecorded, repeated until a pass compiles no new step graph (at most
    `--warmup-passes`): a graph compiling beside a timed round shares its cores, and its steps run
    eagerly. Adaptive speculation reaches more shapes (chain lengths, lookup-only steps) than a fixed
    configuration, and reaches them by its own choices, so one pass may not cover them."""
    for c in args.levels:
        for _ in range(args.warmup_passes):
            before = compiled_graphs(s["base"])
            asyncio.run(level(s["base"], prompts, c, requests_at(args, c), args.max_tokens))
            if compiled_graphs(s["base"]) == before:
                break


def requests_at(args, c: int) -> int:
    return max(c, args.requests_per_level if c > 1 else max(2, args.requests_per_level // 4))


def measure(args, servers: list[dict], prompts: list[str]) -> list[dict]:
    raw = []
    print("| server | concurrency | round | output tok/s | τ | wall s | graphs compiled |")
    print("| --- | --- | --- | --- | --- | --- | --- |", flush=True)
    for c in args.levels:
        n = requests_at(args, c)
        for r in range(args.rounds):
            k = r % len(servers)
            for s in servers[k:] + servers[:k]:
                before = policy_counts(s["base"]) if s["name"].startswith("adaptive (") else None
                graphs_before = compiled_graphs(s["base"])
                res = asyncio.run(level(s["base"], prompts, c, n, args.max_tokens))
                res["compiles"] = int(compiled_graphs(s["base"]) - graphs_before)  # each stalls the round
                if before is not None:  # what the policy chose during this level, and what it believed after
                    res["choices"] = {k: v - before.get(k, 0) for k, v in policy_counts(s["base"]).items()
                                      if v > before.get(k, 0)}
                    res["beliefs"] = policy_beliefs(s["base"])
                raw.append({"server": s["name"], "level": c, "round": r, **res})
                tau = f"{res['tau']:.2f}" if res["tau"] else "-"
                print(f"| {s['name']} | {c} | {r} | {res['tok_s']:.1f} | {tau} | {res['wall']:.1f} | "
                      f"{res['compiles']} |", flush=True)
    return raw


def summarize(args, names: list[str], raw: list[dict]) -> dict[str, dict[int, dict]]:
    med: dict[str, dict[int, dict]] = {}
    for name in names:
        for c in args.levels:
            rs = [x for x in raw if x["server"] == name and x["level"] == c]
            taus = [x["tau"] for x in rs if x["tau"]]
            tok = [x["tok_s"] for x in rs]
            med.setdefault(name, {})[c] = {"tok_s": statistics.median(tok), "min": min(tok), "max": max(tok),
                                           "tau": statistics.median(taus) if taus else None}
    print(f"\nmedians over {args.rounds} rounds\n")
    print("| server | concurrency | output tok/s (median) | min–max | τ (median) | vs plain |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in names:
        for c, m in med[name].items():
            tau = f"{m['tau']:.2f}" if m["tau"] else "-"
            ratio = m["tok_s"] / med["plain"][c]["tok_s"]
            print(f"| {name} | {c} | {m['tok_s']:.1f} | {m['min']:.1f}–{m['max']:.1f} | {tau} | {ratio:.2f}x |")
    adaptive = [n for n in names if n.startswith("adaptive")]  # not a fixed row: the forced-plain one neither
    replicas = [n for n in names if n.startswith("plain #")]
    print()
    for c in args.levels:
        parts = []
        if adaptive:
            best_name = max((n for n in names if n not in adaptive + replicas), key=lambda n: med[n][c]["tok_s"])
            gain = med[adaptive[0]][c]["tok_s"] / med[best_name][c]["tok_s"] - 1
            parts.append(f"adaptive vs best fixed ({best_name}): {gain * 100:+.1f}%")
        if replicas:  # the noise floor: how far apart servers with the same flags ran
            spread = [med[n][c]["tok_s"] / med["plain"][c]["tok_s"] - 1 for n in replicas]
            parts.append(f"identical plain servers: {', '.join(f'{x * 100:+.1f}%' for x in spread)}")
        if parts:
            print(f"concurrency {c}: " + "; ".join(parts))
    return med


def plot(args, med: dict[str, dict[int, dict]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, by_level in med.items():
        ms = list(by_level.values())
        err = [[m["tok_s"] - m["min"] for m in ms], [m["max"] - m["tok_s"] for m in ms]]
        ax.errorbar(list(by_level), [m["tok_s"] for m in ms], yerr=err, marker="o", capsize=3, label=name)
    ax.set(xscale="log", xlabel="concurrency", ylabel=f"output tok/s (median of {args.rounds}, min–max)",
           title=f"{args.target} server throughput")
    ax.set_xticks(args.levels, [str(c) for c in args.levels])
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.png, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft")
    ap.add_argument("--levels", type=int_list, default=[1, 4, 16])
    ap.add_argument("--requests-per-level", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3, help="rounds per level, server order rotated each round")
    ap.add_argument("--chains", type=int_list, default=[3], help="fixed chain lengths to measure (with --draft)")
    ap.add_argument("--trees", type=tree_list, default=[], help="fixed EAGLE-3 trees STEPSxTOPKxNODES, "
                    "comma-separated, e.g. 5x8x32,3x2x6 (with --draft)")
    ap.add_argument("--ngram", action="store_true", help="add an NGRAM row with max(--chains) steps")
    ap.add_argument("--no-adaptive", action="store_true", help="skip the adaptive server (with --draft)")
    ap.add_argument("--adaptive-config", help="JSON for the adaptive server's --speculative-config "
                    "(instead of the default flags; keys it shares with the row's flags must agree)")
    ap.add_argument("--adaptive-flags", default="", help="extra flags for the adaptive server (one string)")
    ap.add_argument("--forced-plain", action="store_true", help="add the adaptive server with its policy forced "
                    "to decode plainly (bench/forced_plain_server.py): what the machinery costs on plain steps")
    ap.add_argument("--plain-replicas", type=int, default=1, help="plain servers to run (2 or more: rows "
                    "'plain #2', ... show how far apart identical servers run, the margin no comparison resolves)")
    ap.add_argument("--kv-cache-memory", type=int, default=10**9,
                    help="KV cache bytes per server (1 GB holds 64 requests of ~300 tokens; with 2 GB, five "
                    "servers held ~21 of 24 GiB and rounds of one server varied up to 2x)")
    ap.add_argument("--no-warmup", action="store_true", help="warm up with one short request only (not every "
                    "level at full length: compiled graphs then compile inside the first round)")
    ap.add_argument("--warmup-passes", type=int, default=3,
                    help="most warm-up passes per level (a pass that compiles no new graph ends it)")
    ap.add_argument("--json", help="write raw round results and medians here")
    ap.add_argument("--png", help="plot median output tok/s per concurrency (min–max bars) here")
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from engine_speed import val_prompts_text

    prompts = val_prompts_text(16)
    servers = []
    try:
        for name, spec in server_rows(args):
            servers.append({"name": name, **start_server(args, name, spec)})
        wait_healthy(servers)
        for s in servers:  # the compiled step graphs (one per batch bucket, window and context) and the
            if args.no_warmup:  # adaptive cost model are ready before the timed rounds
                asyncio.run(level(s["base"], prompts, 1, 1, 8))
            else:
                warm_up(args, s, prompts)
        raw = measure(args, servers, prompts)
    finally:
        stop_servers(servers)
    if args.json:  # the rounds first: they took the time
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rounds": raw}, f, indent=1)
    med = summarize(args, [s["name"] for s in servers], raw)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rounds": raw, "medians": med}, f, indent=1)
    if args.png:
        plot(args, med)


if __name__ == "__main__":
    main()
