"""SpecForge 0.2.0 against our trainer on the same data: SpecForge's EAGLE-3 head trained on exactly our run's
offline-captured features and draft vocab, exported, loaded by our engine, and both heads' τ measured by
our eval on the same validation prompts.

    TSENGINE_NUM_THREADS=1 nice -n 19 .venv/bin/python bench/specforge_ab.py --run runs/smollm2-135m [--out DIR]
        [--max-rows N] [--epochs E] [--max-steps S] [--match-ours] [--num-prompts 4 --max-new-tokens 32]
        [--chain 3,1,4 --tree 5,8,32] [--specforge-venv DIR] [--oracle-prompts 0]
        [--threads N] [--json FILE] [--skip-train] [specforge.override=value ...]

RUN is a finished run of our recipe (capture/, vocab/, export/, data/, summary.json). In OUT (default
RUN/specforge-ab) the bench writes: `sf-data/` our train features as SpecForge offline `.ckpt` files
(input_ids [L], loss_mask [L], hidden_state [1,L,H] bf16 = our post-norm `final`, aux_hidden_state
[1,L,3H] fp32 = our `aux`), `vocab_mapping.pt` (our d2t/t2d), `draft_config.json` (our exported head's
config: same architecture and draft vocab), `target/` (symlinks to the target plus a
model.safetensors.index.json, which SpecForge's target head requires), `specforge.yaml`, then runs
`specforge train` and `specforge export --to sglang` through bench/specforge_runner.py in SpecForge's venv
(made on first use, `ensure_venv`, as shared/anchors/specforge-on-cpu.md found works; the runner adds the
CPU loss fallback at run time),
and evaluates `RUN/export` and SpecForge's head with tsengine.infer.eval (engine backend, greedy, eager).
SpecForge's export is checked as is against our loader (printed); it is evaluated with its weights cast
to our head's dtype under our config (it exports bf16), so only the training differs between the heads.

SpecForge runs with its own defaults (lr 1e-4, warmup 0.015, ttt_length 7, 1 conversation per step)
except what the data forces (max_length, aux layers, vocab, epochs = our recipe's); `--match-ours` sets
lr, warmup and ttt_length to our recipe's. Extra `key=value` args go to `specforge train` as overrides.
Prints a markdown table (head, τ chain, τ tree, training wall s, steps, tokens) and writes OUT/ab.json:
training wall is our trainer's loop and the Σ of SpecForge's per-step times (its process wall, start-up
included, is printed below the table); tokens are loss-masked tokens trained on (rows x epochs).
`--skip-train` re-evaluates the heads of an earlier call in OUT. `--threads N` (default TSENGINE_NUM_THREADS)
sets SpecForge's OMP_NUM_THREADS: on a busy 2-core machine its default 2 threads spin against the other
load (measured: 7 s a step against 0.3 s with 1 thread), so pin 1 there and time ours alike.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
RUNNER = REPO / "bench" / "specforge_runner.py"


# ---- pure conversions (tests/bench/test_specforge_ab.py) -------------------------------------------
def to_specforge_sample(input_ids, loss_mask, aux: torch.Tensor, final: torch.Tensor) -> dict:
    """One of our captured rows as a SpecForge offline EAGLE-3 record (the `.ckpt` dict).

    Our capture holds features for positions 0..L-2 only (the last token is never forwarded: nothing is
    drafted after it), so the ids and mask are cut to the feature rows. Nothing SpecForge trains on is lost:
    its loss at position t needs the final hidden state of t+1, so the last position is never scored."""
    n = aux.shape[0]
    if len(input_ids) == n + 1:
        input_ids, loss_mask = list(input_ids)[:n], list(loss_mask)[:n]
    if aux.shape[0] != n or final.shape[0] != n or len(loss_mask) != n:
        raise ValueError(f"row lengths disagree: ids {n}, mask {len(loss_mask)}, aux {aux.shape[0]}, "
                         f"final {final.shape[0]}")
    return {"input_ids": torch.as_tensor(input_ids, dtype=torch.long),
            "loss_mask": torch.as_tensor(loss_mask, dtype=torch.long),
            "hidden_state": final.to(torch.bfloat16).unsqueeze(0).contiguous(),  # SpecForge's target head is bf16
            # a copy: a slice of a shard shares the shard's storage, and torch.save would write all of it
            "aux_hidden_state": aux.to(torch.float32, copy=True).unsqueeze(0).contiguous()}


def from_specforge_sample(rec: dict) -> tuple[list[int], list[int], torch.Tensor, torch.Tensor]:
    """Inverse of `to_specforge_sample` (final comes back rounded to bf16)."""
    return (rec["input_ids"].tolist(), rec["loss_mask"].tolist(), rec["aux_hidden_state"][0],
            rec["hidden_state"][0].float())


def vocab_mapping(d2t: torch.Tensor, t2d: torch.Tensor) -> dict:
    """Our draft vocab in the form `specforge` loads (`torch.load(path)["d2t"/"t2d"]`)."""
    return {"d2t": d2t.to(torch.int64).clone(), "t2d": t2d.to(torch.bool).clone()}


def index_json(keys, filename: str = "model.safetensors") -> dict:
    """A one-file safetensors index: SpecForge's target head finds lm_head through `*.index.json`."""
    return {"metadata": {}, "weight_map": {k: filename for k in sorted(keys)}}


def specforge_config(*, target: str, draft_config: str, vocab: str, data: str, out: str, max_length: int,
                     aux_layers, epochs: int, lm_head_key: str, seed: int, max_steps: int | None = None,
                     lr: float | None = None, warmup: float | None = None, ttt: int | None = None) -> dict:
    """The `specforge train` run config: offline, one CPU process, DDP (NO_SHARD), sdpa attention."""
    training = {"strategy": "eagle3", "num_epochs": epochs, "batch_size": 1, "fsdp_sharding": "NO_SHARD",
                "attention_backend": "sdpa", "log_interval": 1, "save_interval": 0, "seed": seed,
                "dist_timeout": 60}
    for key, value in (("max_steps", max_steps), ("learning_rate", lr), ("warmup_ratio", warmup),
                       ("ttt_length", ttt)):
        if value is not None:
            training[key] = value
    return {"model": {"target_model_path": target, "draft_model_config": draft_config, "vocab_mapping_path": vocab,
                      "lm_head_key": lm_head_key, "torch_dtype": "float32",
                      "aux_hidden_state_layer_ids": list(aux_layers), "cache_dir": str(Path(out) / "hf-cache")},
            "data": {"hidden_states_path": data, "max_length": max_length, "cache_dir": str(Path(out) / "cache"),
                     "dataloader_num_workers": 0},
            "training": training, "tracking": {"report_to": "none"}, "run_id": "sf-ab", "output_dir": out}


def parse_shape(text: str) -> tuple[int, int, int]:
    s, k, n = (int(x) for x in text.split(","))
    return s, k, n


# ---- stages ----------------------------------------------------------------------------------------
def convert_features(run: Path, out: Path, max_rows: int | None) -> dict:
    from tsengine.train.features import FeatureStore
    from tsengine.train.prepare_data import load_prepared

    rows = load_prepared(run / "data" / "prepared" / "train")
    store = FeatureStore(run / "capture" / "train")
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.ckpt"):
        old.unlink()
    n = len(rows) if max_rows is None else min(max_rows, len(rows))
    tokens = loss_tokens = 0
    for i in range(n):
        aux, final, _ = store.get(i)
        row = rows[i]
        torch.save(to_specforge_sample(row["input_ids"], row["loss_mask"], aux, final), out / f"row-{i:06d}.ckpt")
        tokens, loss_tokens = tokens + len(row["input_ids"]), loss_tokens + sum(row["loss_mask"])
    return {"rows": n, "tokens": tokens, "loss_tokens": loss_tokens}


def target_dir(src: Path, out: Path) -> tuple[Path, str]:
    """Symlinked copy of the target with a model.safetensors.index.json; returns (dir, lm_head key)."""
    from safetensors import safe_open

    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        link = out / f.name
        if not link.exists():
            link.symlink_to(f.resolve())
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
    (out / "model.safetensors.index.json").write_text(json.dumps(index_json(keys), indent=1))
    lm_head = "lm_head.weight" if "lm_head.weight" in keys else "model.embed_tokens.weight"  # tied embeddings
    return out, lm_head


def step_seconds(log_text: str) -> float | None:
    """Σ of SpecForge's per-step `perf/optimizer_step_time_s` over its `step N: {...}` lines (log_interval=1):
    its training loop, without start-up, data indexing and export."""
    times = [ast.literal_eval(m).get("perf/optimizer_step_time_s", 0.0)
             for m in re.findall(r"^step \d+: (\{.*\})$", log_text, flags=re.M)]
    return round(sum(times), 1) if times else None


SPECFORGE_PACKAGES = [  # what the offline path imports; not SpecForge's declared CUDA stack (sglang, flash-attn, ...)
    "torch==2.13.0", "transformers==5.8.1", "datasets", "accelerate", "safetensors", "pydantic", "pyyaml", "tqdm",
    "numpy", "psutil", "huggingface-hub", "requests", "typing-extensions", "triton"]


def ensure_venv(venv: Path) -> None:
    """SpecForge 0.2.0 in its own venv, installed `--no-deps` with the packages its offline path needs: its
    declared dependencies would pull a CUDA torch and replace a CPU build (shared/anchors/specforge-on-cpu.md)."""
    if any((venv / "lib").glob("python*/site-packages/specforge")):
        return
    print(f"setting up SpecForge 0.2.0 in {venv} (once)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "--no-deps", "specforge==0.2.0"], check=True)
    subprocess.run([*pip, *SPECFORGE_PACKAGES], check=True)


def run_specforge(venv: Path, args: list[str], log: Path, threads: int | None = None) -> tuple[float, dict]:
    cmd = ["nice", "-n", "19", str(venv / "bin" / "python"), str(RUNNER), *args]
    env = {**os.environ, "PYTHONNOUSERSITE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if threads:
        env |= {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    print("$", *([f"OMP_NUM_THREADS={threads}"] if threads else []), *cmd, flush=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=env)
    wall = time.perf_counter() - t0
    text = log.read_text()
    if proc.returncode:
        sys.exit(f"specforge {args[0]} failed (exit {proc.returncode}); last lines of {log}:\n"
                 + "\n".join(text.splitlines()[-25:]))
    state = re.findall(r"^SPECFORGE_STATE (.*)$", text, flags=re.M)
    return wall, (json.loads(state[-1]) if state else {})


def our_format(sf_export: Path, ours: Path, dest: Path, target_cfg) -> tuple[Path, list[str]]:
    """SpecForge's export as the head we evaluate. It is first validated as is (the problems, if any, are
    returned and printed: [] means our engine loads it unchanged). It is evaluated as is only when it also
    has our head's dtype; otherwise (SpecForge exports bf16) its weights, cast to our dtype, go under our
    exported config (same architecture), so both heads run alike and only the training differs."""
    from safetensors.torch import save_file

    from tsengine.eagle3.format import EXPORT_KEYS, read_config, read_tensors, validate
    from tsengine.train.features import DTYPES

    tensors = read_tensors(sf_export)
    try:
        sf_cfg = read_config(sf_export, target_cfg.num_hidden_layers)
        problems = validate(sf_cfg, tensors, target_cfg, where=str(sf_export))
    except Exception as e:  # noqa: BLE001 - a config we cannot read is one more reason to convert
        sf_cfg, problems = None, [str(e)]
    ours_cfg = json.loads((ours / "config.json").read_text())
    if not problems and sf_cfg.dtype == ours_cfg["torch_dtype"]:
        return sf_export, []
    dtype = DTYPES[ours_cfg["torch_dtype"]]
    dest.mkdir(parents=True, exist_ok=True)
    keep = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()
            if k in EXPORT_KEYS}
    save_file(keep, str(dest / "model.safetensors"), metadata={"format": "pt"})
    (dest / "config.json").write_text(json.dumps(ours_cfg, indent=2) + "\n")
    print(f"SpecForge's export ({sf_cfg.dtype if sf_cfg else '?'}) "
          + ("loads in our engine as is" if not problems else "does not load as is:\n  - " + "\n  - ".join(problems))
          + f"\n  evaluated: its weights as {ours_cfg['torch_dtype']} under our config, in {dest}", flush=True)
    return dest, problems


def evaluate(run: Path, heads: dict[str, Path], shapes, num_prompts: int, new: int, oracle: int) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tsengine.eagle3.format import load_head
    from tsengine.infer.eval import measure, prompts_from, table
    from tsengine.targets import resolve

    summary = json.loads((run / "summary.json").read_text())
    target = resolve(summary["recipe"]["target"])
    tok = AutoTokenizer.from_pretrained(target)
    val_rows = json.loads((run / "data" / "prepared" / "val" / "stage.json").read_text())["source"]
    prompts = prompts_from(val_rows, tok, num_prompts)
    results = {}
    for name, head_dir in heads.items():
        def reference(head_dir=head_dir):
            model = AutoModelForCausalLM.from_pretrained(target, torch_dtype=torch.float32).eval()
            head = load_head(head_dir, target=model.config, embeddings=model.get_input_embeddings().weight,
                             dtype=torch.float32)
            return model, tok, head

        res = measure("engine", prompts, shapes, new, target=target, draft=str(head_dir), reference=reference,
                      oracle_prompts=oracle, progress=False, enforce_eager=True)
        print(f"{name}:\n{table(res)}", flush=True)
        results[name] = res
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", required=True, type=Path, help="a finished run directory of our recipe")
    p.add_argument("--out", type=Path, help="work directory (default RUN/specforge-ab)")
    p.add_argument("--specforge-venv", type=Path, default=None,
                   help="SpecForge's own venv, created on first use (default: TSENGINE_CACHE/specforge-venv)")
    p.add_argument("--max-rows", type=int, help="train SpecForge on the first N rows only (smoke runs)")
    p.add_argument("--epochs", type=int, help="default: our recipe's train.epochs")
    p.add_argument("--max-steps", type=int, help="SpecForge training.max_steps (default: none)")
    p.add_argument("--match-ours", action="store_true", help="SpecForge lr, warmup, ttt_length = our recipe's")
    p.add_argument("--chain", type=parse_shape, default=None, help="S,K,N (default: the recipe's eval.chain)")
    p.add_argument("--tree", type=parse_shape, default=None, help="S,K,N (default: the recipe's eval.tree)")
    p.add_argument("--num-prompts", type=int, help="default: the recipe's eval.num_prompts")
    p.add_argument("--max-new-tokens", type=int, help="default: the recipe's eval.max_new_tokens")
    p.add_argument("--oracle-prompts", type=int, default=0, help="prompts per shape checked by the reference")
    p.add_argument("--threads", type=int, default=int(os.environ.get("TSENGINE_NUM_THREADS", 0)) or None,
                   help="intra-op threads of SpecForge's process (default: TSENGINE_NUM_THREADS, else torch's)")
    p.add_argument("--skip-train", action="store_true", help="reuse OUT/sf-export from an earlier call")
    p.add_argument("--json", type=Path, help="default OUT/ab.json")
    p.add_argument("overrides", nargs="*", help="extra `specforge train` overrides, e.g. training.learning_rate=3e-4")
    args = p.parse_args()

    from transformers import AutoConfig

    from tsengine.targets import cache_root, resolve
    from tsengine.train.vocab import load_vocab

    args.specforge_venv = (args.specforge_venv or cache_root() / "specforge-venv").expanduser()
    if not args.skip_train:
        ensure_venv(args.specforge_venv)

    run = args.run.expanduser().resolve()
    out = (args.out or run / "specforge-ab").expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    summary = json.loads((run / "summary.json").read_text())
    recipe, ours_cfg = summary["recipe"], json.loads((run / "export" / "config.json").read_text())
    rt, ev = recipe["train"], recipe["eval"]
    target_src = Path(resolve(recipe["target"]))
    target_cfg = AutoConfig.from_pretrained(target_src)
    epochs = args.epochs or rt["epochs"]
    sf_export = out / "sf-export"
    data = {"rows": None, "tokens": None}
    sf_wall, sf_steps, sf_loop = None, None, None
    if not args.skip_train:
        data = convert_features(run, out / "sf-data", args.max_rows)
        d2t, t2d = load_vocab(Path((run / "vocab" / "current").read_text().strip()))
        torch.save(vocab_mapping(d2t, t2d), out / "vocab_mapping.pt")
        (out / "draft_config.json").write_text(json.dumps(ours_cfg, indent=2))
        tdir, lm_head_key = target_dir(target_src, out / "target")
        match = {"lr": rt["lr"], "warmup": rt["warmup_ratio"], "ttt": rt["ttt_steps"]} if args.match_ours else {}
        cfg = specforge_config(target=str(tdir), draft_config=str(out / "draft_config.json"),
                               vocab=str(out / "vocab_mapping.pt"), data=str(out / "sf-data"),
                               out=str(out / "sf-train"), max_length=recipe["data"]["max_length"],
                               aux_layers=ours_cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"],
                               epochs=epochs, lm_head_key=lm_head_key, seed=recipe["seed"],
                               max_steps=args.max_steps, **match)
        import yaml

        (out / "specforge.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        sf_wall, state = run_specforge(args.specforge_venv, ["train", "-c", str(out / "specforge.yaml"),
                                                             *args.overrides], out / "specforge-train.log",
                                       args.threads)
        sf_steps = state.get("global_step", state.get("step"))
        sf_loop = step_seconds((out / "specforge-train.log").read_text())
        run_specforge(args.specforge_venv, ["export", "--to", "sglang", "--checkpoint", str(out / "sf-train"),
                                            "--draft-config", str(out / "draft_config.json"), "--output-dir",
                                            str(sf_export), "--vocab-mapping", str(out / "vocab_mapping.pt")],
                      out / "specforge-export.log")
        (out / "sf-meta.json").write_text(json.dumps({"data": data, "wall_s": sf_wall, "loop_s": sf_loop,
                                                      "threads": args.threads,
                                                      "steps": sf_steps, "state": state, "epochs": epochs}))
    else:
        meta = json.loads((out / "sf-meta.json").read_text())
        data, sf_wall, sf_steps, epochs = meta["data"], meta["wall_s"], meta["steps"], meta["epochs"]
        sf_loop, args.threads = meta.get("loop_s"), meta.get("threads")  # as that call trained
    sf_head, problems = our_format(sf_export, run / "export", out / "sf-export-tsengine", target_cfg)
    shapes = [args.chain or tuple(ev["chain"])] + ([args.tree or tuple(ev["tree"])] if (args.tree or ev["tree"])
                                                   else [])
    res = evaluate(run, {"ours": run / "export", "specforge": sf_head}, shapes, args.num_prompts or ev["num_prompts"],
                   args.max_new_tokens or ev["max_new_tokens"], args.oracle_prompts)
    tr = summary["train"]
    # "tokens" = loss-masked (trained-on) tokens passed through training, as our trainer counts them
    sf_tokens = None if data.get("loss_tokens") is None else data["loss_tokens"] * epochs
    if args.max_steps and data["rows"]:
        sf_tokens = round(data["loss_tokens"] / data["rows"] * min(args.max_steps, data["rows"] * epochs))
    rows = {"ours": (tr["wall_s"], tr["steps"], tr["tokens"]), "specforge": (sf_loop, sf_steps, sf_tokens)}
    keys = ["{},{},{}".format(*s) for s in shapes]
    print(f"\n| head | τ chain {keys[0]} | τ tree {keys[1] if len(keys) > 1 else '-'} | training wall s | steps | "
          "tokens |\n| --- | --- | --- | --- | --- | --- |")
    for name, (wall, steps, toks) in rows.items():
        taus = [f"{res[name][k]['tau']:.3f}" for k in keys] + ["-"] * (2 - len(keys))
        wall_s = "-" if wall is None else f"{wall:.1f}"
        print(f"| {name} | {taus[0]} | {taus[1]} | {wall_s} | {steps if steps is not None else '-'} | "
              f"{toks if toks is not None else '-'} |")
    if sf_wall is not None:
        print(f"\nspecforge: {data['rows']} rows x {epochs} epochs, 1 row per step; training wall = Σ of its per-step "
              f"times (ours: the trainer's loop); the whole `specforge train` process took {sf_wall:.1f} s "
              f"(OMP_NUM_THREADS: {args.threads or 'unset'})")
    dest = args.json or out / "ab.json"
    dest.write_text(json.dumps({"rows": {k: dict(zip(("wall_s", "steps", "tokens"), v)) for k, v in rows.items()},
                                "specforge_process_wall_s": sf_wall,
                                "eval": res, "converted": problems, "sf_head": str(sf_head)}, indent=1, default=str))


if __name__ == "__main__":
    main()
