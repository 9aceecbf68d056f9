"""What bf16 buys the training pipeline on this CPU: regeneration + capture tok/s and the training step, fp32
against bf16, side by side in one process (the order alternates so drift hits both).

    python bench/precision_speed.py [--prompts 64 --rounds 2]

Regeneration: the budget's own probe (train/budget.py) on the built-in training prompts (a seeded subset, as
bench/regen_speed.py takes them) at the recipe's batch: features captured, half the answers greedy and
half sampled at T 0.7, as the budgeted regenerate stage runs; a step that compiled a graph is priced at the
median step (steady state). Training: the
recipe's step (train/budget.py's probe: TTT unroll, loss, backward, AdamW) on the micro-batch shapes the
budget probe sees, fp32 against bf16 autocast. Results: docs/benchmarks.md, "bf16 regeneration and training".
On a CPU without bf16 units (precision.bf16_units() is None) bf16 is emulated: the table shows what that costs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

REPO = Path(__file__).resolve().parent.parent


def regen_tok_s(tok, rows: list, layers, dtype: str) -> float:
    """Output tok/s of the budget's own regeneration probe (capture on, half the rows sampled) in `dtype`."""
    from tsengine.train.budget import _regen_probe
    from tsengine.train.recipe import load

    r = load(str(REPO / "recipes" / "smollm2-135m.yaml"), [f"regen.dtype={dtype}"])
    seconds, tokens = _regen_probe(r, tok, rows, Path(tempfile.mkdtemp()) / "probe", layers)
    return tokens / seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()

    from regen_speed import prompts

    from tsengine.eagle3.config import Eagle3Config, default_aux_layer_ids
    from tsengine.model.precision import bf16_units
    from tsengine.targets import load_target, resolve
    from tsengine.train.budget import _train_probe
    from tsengine.train.recipe import load

    path = str(resolve("smollm2-135m"))
    model, tok = load_target(path)
    rows = prompts(args.prompts)
    layers = default_aux_layer_ids(model.config.num_hidden_layers)
    print(f"bf16 unit: {bf16_units('cpu') or 'none (bf16 is emulated)'}", flush=True)
    regen = {"float32": [], "bfloat16": []}
    train = {(m, s): [] for m in ("no", "bf16") for s in ((3, 170), (1, 512))}
    for i in range(args.rounds):
        for dtype in (("float32", "bfloat16") if i % 2 == 0 else ("bfloat16", "float32")):
            regen[dtype].append(regen_tok_s(tok, rows, layers, dtype))
            print(f"regenerate + capture {dtype}: {regen[dtype][-1]:.1f} tok/s", flush=True)
        for mode, shape in train:
            r = load(str(REPO / "recipes" / "smollm2-135m.yaml"), [f"train.mixed_precision={mode}"])
            cfg = Eagle3Config.for_target(model.config, draft_vocab_size=r.vocab.draft_vocab_size, aux_layer_ids=None)
            train[mode, shape].append(_train_probe(r, model, cfg, shape[0], shape[1], 120, steps=5) * 1000)
            print(f"training step {mode} {shape}: {train[mode, shape][-1]:.0f} ms", flush=True)
    med = statistics.median
    print("\n| work | fp32 | bf16 | bf16 buys |\n| --- | --- | --- | --- |")
    fp32, bf16 = regen["float32"], regen["bfloat16"]
    print(f"| regenerate + capture, tok/s | {', '.join(f'{x:.1f}' for x in fp32)} | "
          f"{', '.join(f'{x:.1f}' for x in bf16)} | {med(bf16) / med(fp32):.2f}x |")
    for shape in ((3, 170), (1, 512)):
        a, b = train["no", shape], train["bf16", shape]
        print(f"| training step [{shape[0]} x {shape[1]}], ms | {', '.join(f'{x:.0f}' for x in a)} | "
              f"{', '.join(f'{x:.0f}' for x in b)} | {med(a) / med(b):.2f}x |")


if __name__ == "__main__":
    main()
