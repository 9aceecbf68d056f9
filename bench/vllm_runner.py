"""Runs inside the vLLM venv (bench/interop_vllm.py makes it): no tsengine import. Reads a job JSON, writes
results JSON: per configuration and batch size, every prompt's output ids, the wall time and vLLM's
speculative-decoding counters over that batch size's requests.

    VENV/bin/python bench/vllm_runner.py JOB.json OUT.json
"""

from __future__ import annotations

import json
import sys
import time


def counters(llm) -> dict:
    """vLLM's spec-decode counters so far (v1 `LLM.get_metrics`; needs disable_log_stats=False)."""
    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": []}
    names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted"}
    for m in llm.get_metrics():
        if m.name in names:
            out[names[m.name]] += int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            vals = [int(v) for v in m.values]
            acc = out["accepted_per_pos"]
            out["accepted_per_pos"] = [a + b for a, b in zip(acc + [0] * len(vals), vals)] if acc else vals
    return out


def minus(a: dict, b: dict) -> dict:
    return {k: ([x - y for x, y in zip(a[k], b[k] or [0] * len(a[k]))] if isinstance(a[k], list) else a[k] - b[k])
            for k in a}


def main() -> None:
    import vllm
    from vllm import LLM, SamplingParams

    job = json.loads(open(sys.argv[1]).read())
    params = SamplingParams(temperature=0, max_tokens=job["max_tokens"], ignore_eos=True)
    results = {"vllm_version": vllm.__version__, "configs": {}}
    for cfg in job["configs"]:
        kw = {"speculative_config": cfg["speculative_config"]} if cfg.get("speculative_config") else {}
        t0 = time.perf_counter()
        llm = LLM(model=job["target"], dtype=job.get("dtype", "float32"), max_num_seqs=max(job["batches"]),
                  max_model_len=job.get("max_model_len", 1024), disable_log_stats=False, seed=0, **kw)
        load_s = time.perf_counter() - t0
        prompts = [{"prompt_token_ids": ids} for ids in job["prompts"]]
        llm.generate(prompts[:max(job["batches"])], params, use_tqdm=False)  # warm-up: every shape compiled
        by_batch = {}
        for b in job["batches"]:
            before, outs, wall = counters(llm), [], 0.0
            for i in range(0, len(prompts), b):
                t0 = time.perf_counter()
                got = llm.generate(prompts[i:i + b], params, use_tqdm=False)
                wall += time.perf_counter() - t0
                outs += [list(o.outputs[0].token_ids) for o in got]
            by_batch[str(b)] = {"outputs": outs, "wall_s": wall, "tokens": sum(map(len, outs)),
                                "counters": minus(counters(llm), before)}
        results["configs"][cfg["name"]] = {"load_s": load_s, "batches": by_batch}
        del llm
    with open(sys.argv[2], "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
