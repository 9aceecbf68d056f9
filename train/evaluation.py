"""The pipeline's last stage: τ of the exported head, so a run ends with the number that matters and not
only with training losses."""

from __future__ import annotations

import json
import time
from pathlib import Path

QUICK_EVAL = (4, 64)  # (prompts, new tokens) when train.max_steps is set: see evaluate


def evaluate(r, model, tok, root: Path, user_sized: bool = False) -> dict:
    """τ of the exported head on validation prompts (the split's own prompts, not the regenerated answers),
    measured by `r.eval.backend` (infer/eval.py: the engine, checked against the reference oracle on
    `eval.oracle_prompts` prompts per shape; a decisive mismatch fails the run after eval.json is written).

    A quick run (train.max_steps set) gets a quick eval: at most QUICK_EVAL prompts and new tokens, whatever
    the recipe file says (its head is a smoke test), unless `user_sized`: eval.num_prompts or
    eval.max_new_tokens given on the command line are the user's choice and are kept. The recipe's full
    eval of such a head is one `python -m tsengine.infer.eval` away (printed)."""
    from tsengine.eagle3.format import load_head
    from tsengine.infer.eval import measure, prompts_from, raise_on_mismatch, table
    from tsengine.targets import resolve

    e = r.eval
    num, new = e.num_prompts, e.max_new_tokens
    src = root / "data" / "prepared" / "val" / "stage.json"
    val_rows = json.loads(src.read_text())["source"]
    quick = r.train.max_steps is not None and not user_sized
    if quick:
        num, new = min(num, QUICK_EVAL[0]), min(new, QUICK_EVAL[1])
        (s, k, n), tree = e.chain, (" --tree {},{},{}".format(*e.tree) if e.tree else "")
        print(f"eval: quick run (train.max_steps={r.train.max_steps}): {num} prompts x {new} new tokens; the "
              f"recipe's eval: python -m tsengine.infer.eval --target {r.target} --draft {root / 'export'} --prompts "
              f"{val_rows} --steps {s} --topk {k} --num-draft-tokens {n}{tree} --num-prompts {e.num_prompts} "
              f"--max-new-tokens {e.max_new_tokens} --backend {e.backend}")

    def reference() -> tuple:
        head = load_head(root / "export", target=model.config, embeddings=model.get_input_embeddings().weight,
                         dtype=next(model.parameters()).dtype)
        return (model.float() if model.device.type == "cpu" else model), tok, head

    shapes = [e.chain] + ([e.tree] if e.tree else [])
    t0 = time.time()
    # eagerly: a one-off eval of a few thousand tokens per shape does not earn back a graph's cold compile
    # (measured: docs/benchmarks.md, "Budget planning"); the tokens are the same either way
    res = measure(e.backend, prompts_from(val_rows, tok, num), shapes, new, target=resolve(r.target),
                  draft=str(root / "export"), reference=reference, oracle_prompts=min(e.oracle_prompts, num),
                  **({"enforce_eager": True} if e.backend == "engine" else {}))
    wall = round(time.time() - t0, 1)
    print(table(res))
    (root / "eval.json").write_text(json.dumps(res, indent=1))
    raise_on_mismatch(res)
    out = {k: {f: v[f] for f in ("tau", "tokens", "verify_steps", "backend", "wall_s")}
           | ({"oracle": [p["status"] for p in v["oracle"]["prompts"]]} if "oracle" in v else {})
           for k, v in res.items()}
    return out | {"num_prompts": num, "max_new_tokens": new, "wall_s": wall}
