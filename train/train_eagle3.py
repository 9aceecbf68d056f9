"""Distill an EAGLE-3 head: run every stage the recipe needs that is not done yet, train, export, evaluate.

    accelerate launch train/train_eagle3.py --recipe recipes/smollm2-135m.yaml [key.sub=value ...]
        [--output-dir DIR] [--max-samples N] [--max-steps N] [--dry-run]

Stages (each cached under DIR, keyed by its inputs): prompts/data -> regenerate (target answers) ->
prepare (tokens + loss mask) -> vocab (d2t/t2d) -> [dump features, offline mode] -> train -> export
(DIR/export) -> eval (DIR/eval.json). Without `accelerate launch` it runs as one process. Data stages run
on rank 0 while the other ranks wait, except regeneration with capture (offline + engine), which every
rank does for its share of the rows; training and feature dumps are data-parallel.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tsengine.train import recipe as recipes
from tsengine.errors import UserError, run_main


def _source_splits(r, root: Path) -> tuple[list, list]:
    """(train, val) rows: the built-in collection, or the user's data with a held-out 5% (at least one
    row). Every row gets an `id` (its own, else its index in the file), which names it in later stages.
    `data.max_samples` picks a seeded subset of the source's train rows; target-written prompts
    (`data.synthetic_prompts`) come on top of it, all of them, as many as the user asked for."""
    import hashlib

    from tsengine.train.data import load_rows
    from tsengine.train.regenerate import row_id

    def rows_of(source: str, split: str) -> list:
        return [{**row, "id": row_id(row, i)} for i, row in enumerate(load_rows(source, split))]

    if r.data.source == "builtin":
        from tsengine.train.prompts import synthetic, write_jsonl

        paths = write_jsonl(root / "data" / "prompts")
        train = _subset(rows_of(str(paths[0]), "train"), r.data.max_samples, r.seed)
        return synthetic.add_synthetic(train, r, root), rows_of(str(paths[1]), "train")
    from tsengine.train.prompts.synthetic import require_builtin

    require_builtin(r)  # target-written prompts are seeded by the built-in categories
    rows = rows_of(r.data.source, r.data.split)
    if r.data.val_source:
        return _subset(rows, r.data.max_samples, r.seed), rows_of(r.data.val_source, r.data.val_split)
    pick = [int(hashlib.sha256(x["id"].encode()).hexdigest()[:8], 16) % 20 == 0 for x in rows]
    if not any(pick) and len(rows) > 1:
        pick[-1] = True
    if len(rows) < 2 or all(pick):
        raise UserError(f"data {r.data.source}: {len(rows)} row(s) cannot be split into train and validation; "
                        "give more rows or data.val_source")
    train = [x for x, p in zip(rows, pick) if not p]
    return _subset(train, r.data.max_samples, r.seed), [x for x, p in zip(rows, pick) if p]


def _answer_rows(r, rows: list, split: str, limit: int | None) -> list:
    """The prompts this run uses (a seeded subset when limited) as answer rows: several per prompt with
    regen.samples_per_prompt / include_greedy on the train split; validation keeps one answer per prompt
    (greedy unless only samples are asked for) so that val numbers stay comparable across recipes."""
    from tsengine.train.regenerate import answer_rows

    g = r.regen
    rows = _subset(rows, limit, r.seed)
    if split == "train":
        return answer_rows(rows, g.temperature, g.samples_per_prompt, g.include_greedy)
    return answer_rows(rows, 0.0 if g.include_greedy else g.temperature)


def _captures(r) -> bool:
    """Offline features from the engine's own forward: no second target pass."""
    return r.data.regenerate and r.regen.backend == "engine" and r.features.mode == "offline"


def _used(r, model, tok, rows: list, split: str, root: Path, limit: int | None) -> Path:
    """The rows this run trains on, with regenerated answers if asked, written to data/used/<split>.jsonl:
    the input of the prepare stage."""
    if r.data.regenerate:
        rows = _answer_rows(r, rows, split, limit)
        out = root / "data" / "regen" / f"{split}.jsonl"
        _regenerate(r, model, tok, rows, out)
        want = {x["id"] for x in rows}
        rows = [x for x in map(json.loads, out.read_text().splitlines()) if x["id"] in want]
    else:
        rows = _subset(rows, limit, r.seed)
    used = root / "data" / "used" / f"{split}.jsonl"
    used.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(x, ensure_ascii=False, default=str) + "\n" for x in rows)
    if not used.exists() or used.read_text() != text:  # same bytes keep the prepared data's cache key
        used.write_text(text)
    return used


def _regenerate(r, model, tok, rows: list, out: Path) -> None:
    """Answers are cached by row id across runs: a larger max_samples only adds rows; other
    regeneration settings (or another source) start over."""
    from tsengine.train.regenerate import Regenerator
    from tsengine.train.stages import tokenizer_digest

    # what decides an answer: the engine keys its draws by row id, so its batch size does not count
    settings = {"source": r.data.source, "target": r.target, "tokenizer": tokenizer_digest(tok),
                "max_length": r.data.max_length,
                **r.regen.model_dump(exclude={"batch_size"} if r.regen.backend == "engine" else set())}
    side = out.with_suffix(".settings.json")
    if side.exists() and json.loads(side.read_text()) != settings:
        out.unlink(missing_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    side.write_text(json.dumps(settings))
    from tsengine.train.capture import log_wall
    from tsengine.train.data import Skipped

    g, t0, skipped, tokens = r.regen, time.time(), Skipped(), None  # HF's count is not tracked
    if g.backend == "engine":
        from tsengine.train.regen_engine import EngineRegenerator
        from tsengine.targets import resolve

        regen = EngineRegenerator(resolve(r.target), tok, g.batch_size, g.max_new_tokens, g.top_p, g.seed,
                                  r.data.max_length)
        skipped = regen.run(rows, out)
        tokens = regen.tokens_out
    else:  # HF generate samples one temperature per call: one pass per temperature
        for t in sorted({x["temperature"] for x in rows}):
            part = [x for x in rows if x["temperature"] == t]
            skipped.reasons.update(Regenerator(model, tok, g.batch_size, g.max_new_tokens, t, g.top_p, g.seed)
                                   .run(part, out).reasons)
    if skipped.reasons:
        print(f"regenerate: {skipped.summary(len(rows) - sum(skipped.reasons.values()))}")
    log_wall(out.with_suffix(".wall.json"), time.time() - t0, tokens)


def _subset(rows: list, limit: int | None, seed: int) -> list:
    """`limit` rows spread over the whole file (seeded), not its first ones: files are often grouped."""
    if limit is None or limit >= len(rows):
        return rows
    import random

    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)  # one permutation: a larger limit only adds rows (caches grow)
    keep = sorted(order[:limit])
    return [rows[i] for i in keep]


def run(r, dry_run: bool = False, user_sized: bool = False) -> dict:
    """`user_sized`: the eval's size was set on the command line (see `_eval`)."""
    import torch
    from accelerate import PartialState

    from tsengine.eagle3.config import Eagle3Config

    from datetime import timedelta

    # Data stages and the final eval run on rank 0 while the others wait at a barrier: a long collective
    # timeout, or NCCL's 10-minute watchdog kills the waiting ranks during regeneration.
    state = PartialState(cpu=not torch.cuda.is_available(), timeout=timedelta(hours=24))
    root = Path(r.output_dir)
    if dry_run:
        return dry(r)
    from tsengine.targets import load_target

    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    model, tok = load_target(r.target, dtype=dtype, device=str(state.device))
    report: dict = {"recipe": r.model_dump(mode="json")}
    prepared = {}
    limits = {"train": None, "val": r.data.max_val_samples}  # train: subset by _source_splits
    cfg = Eagle3Config.for_target(model.config, draft_vocab_size=r.vocab.draft_vocab_size,
                                  aux_layer_ids=r.head.aux_layer_ids)
    layers = cfg.aux_layer_ids
    sharded = _captures(r) and state.num_processes > 1
    if sharded:  # every rank regenerates and captures its share, on its own device
        from tsengine.train.capture import regenerate_share

        with state.main_process_first():  # rank 0 writes the prompt files (and target-written prompts)
            splits = dict(zip(("train", "val"), _source_splits(r, root)))
        for split, rows in splits.items():
            regenerate_share(r, tok, _answer_rows(r, rows, split, limits[split]), split, root, layers,
                             rank=state.process_index, world=state.num_processes, device=str(state.device))
        state.wait_for_everyone()
    with state.main_process_first():
        if state.is_main_process:
            from tsengine.train.capture import capture_split, finalize_split
            from tsengine.train.prepare_data import prepare
            from tsengine.train.vocab import build_vocab

            splits = dict(zip(("train", "val"), _source_splits(r, root)))
            for split, rows in splits.items():
                if _captures(r):
                    rows = _answer_rows(r, rows, split, limits[split])
                    prepared[split] = (finalize_split if sharded else capture_split)(r, tok, rows, split, root, layers)[0]
                    continue
                used = _used(r, model, tok, rows, split, root, limits[split])
                prepared[split] = prepare(tok, used, root / "data" / "prepared" / split, r.data.max_length)
            vocab_dir = build_vocab(tok, prepared["train"], model.config.vocab_size, r.vocab.draft_vocab_size,
                                    root / "vocab")
            (root / "vocab" / "current").write_text(str(vocab_dir))
    from tsengine.train.prepare_data import load_prepared
    from tsengine.train.vocab import load_vocab

    prepared = {s: root / "data" / "prepared" / s for s in ("train", "val")}
    vocab_dir = Path((root / "vocab" / "current").read_text())
    data = {s: load_prepared(p) for s, p in prepared.items()}
    from tsengine.eagle3.head import Eagle3Head

    head = Eagle3Head(cfg)
    head.init_weights(r.seed, std=r.head.init_std)
    head.set_vocab_map(*load_vocab(vocab_dir))
    if r.head.lm_head_from_target:
        head.init_from_target(model)
    stores = {"train": None, "val": None}
    if r.features.mode == "offline":
        from tsengine.train import dump_features
        from tsengine.train.features import FeatureStore

        for s in ("train", "val"):
            out = root / "features" / s
            if _captures(r):  # written while regenerating (train/capture.py)
                out = root / "capture" / s
            else:
                dump_features.run(model, data[s], prepared[s], cfg.aux_layer_ids, out, r.features.dtype,
                                  r.train.batch_tokens, r.features.shard_tokens, state, target_name=r.target)
            stores[s] = FeatureStore(out)
        report["feature_bytes_per_token"] = stores["train"].meta["bytes_per_token"]
    if r.head.fc_init == "scaled":
        _scale_fc(head, model, data["train"], stores["train"])
    from tsengine.train.trainer import Trainer

    trainer = Trainer(r, head, model, data["train"], data["val"], stores["train"], stores["val"])
    resumed = trainer.resume()
    report["resumed_from_step"] = trainer.state.step if resumed else None
    report["train"] = trainer.train()
    if state.is_main_process:
        report["data"] = {s: json.loads((p / "stage.json").read_text()) for s, p in prepared.items()}
        report["vocab"] = json.loads((vocab_dir / "stage.json").read_text())
        for split in ("train", "val"):
            walls = [json.loads(p.read_text()) for p in sorted((root / "data" / "regen").glob(f"{split}.*wall.json"))]
            if walls:  # one file, or one per rank (ranks run side by side: the stage lasts the longest one)
                tokens = [w["tokens_out"] for w in walls]
                report.setdefault("regen", {})[split] = {"wall_s": max(w["wall_s"] for w in walls), "ranks": len(walls),
                                                         "tokens_out": None if None in tokens else sum(tokens)}
        report["eval"] = _eval(r, model, tok, root, user_sized)
        (root / "summary.json").write_text(json.dumps(report, indent=1))
        print(json.dumps({k: report[k] for k in ("train", "eval") if k in report}, indent=1))
    state.wait_for_everyone()
    return report


def _eval(r, model, tok, root: Path, user_sized: bool = False) -> dict:
    """τ of the exported head on validation prompts (the split's own prompts, not the regenerated answers),
    measured by `r.eval.backend` (infer/eval.py: the engine, checked against the reference oracle on
    `eval.oracle_prompts` prompts per shape; a decisive mismatch fails the run after eval.json is written).

    A quick run (train.max_steps set) gets a quick eval: at most QUICK_EVAL prompts and new tokens, whatever
    the recipe file says (its head is a smoke test), unless `user_sized`: eval.num_prompts or
    eval.max_new_tokens given on the command line are the user's choice and are kept. The recipe's full
    eval of such a head is one `python -m tsengine.infer.eval` away (printed)."""
    from tsengine.infer.eval import measure, prompts_from, raise_on_mismatch, table
    from tsengine.eagle3.format import load_head
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
    res = measure(e.backend, prompts_from(val_rows, tok, num), shapes, new, target=resolve(r.target),
                  draft=str(root / "export"), reference=reference, oracle_prompts=min(e.oracle_prompts, num))
    wall = round(time.time() - t0, 1)
    print(table(res))
    (root / "eval.json").write_text(json.dumps(res, indent=1))
    raise_on_mismatch(res)
    out = {k: {f: v[f] for f in ("tau", "tokens", "verify_steps", "backend", "wall_s")}
           | ({"oracle": [p["status"] for p in v["oracle"]["prompts"]]} if "oracle" in v else {})
           for k, v in res.items()}
    return out | {"num_prompts": num, "max_new_tokens": new, "wall_s": wall}


QUICK_EVAL = (4, 64)  # (prompts, new tokens) when train.max_steps is set: see _eval


def _scale_fc(head, model, data, store) -> None:
    """fc columns scaled from a sample of target features (train/fc_init.py); same on every rank."""
    import torch

    from tsengine.train.fc_init import sample_aux, scale_fc_columns
    from tsengine.train.features import TargetFeatures

    feats = TargetFeatures(model, head.config.aux_layer_ids)

    def aux_of(i: int):
        if store is not None:
            return store.get(i)[0]
        ids = torch.tensor([data[i]["input_ids"]], device=next(model.parameters()).device)
        return feats(ids, torch.ones_like(ids)).aux[0].cpu()

    scale_fc_columns(head.fc.weight, sample_aux(aux_of, [len(x) for x in data["input_ids"]]))


def dry(r) -> dict:
    """Validate a recipe without a GPU or the hub: schema (already), accelerate/DeepSpeed files, and the
    head's shape for the target (from the hub, or from recipes/targets/<org>--<name>.json offline)."""
    import yaml
    from transformers import AutoConfig

    from tsengine.eagle3.config import Eagle3Config
    from tsengine.targets import resolve

    info: dict = {"recipe": "ok"}
    repo = Path(__file__).resolve().parent.parent / "recipes"
    for f in sorted((repo / "accelerate").glob("*.yaml")):
        yaml.safe_load(f.read_text())
    for f in sorted((repo / "deepspeed").glob("*.json")):
        json.loads(f.read_text())
    info["launch_configs"] = "ok"
    try:
        tc, origin = AutoConfig.from_pretrained(resolve(r.target)), "target"
    except (OSError, ValueError):
        snap = repo / "targets" / (r.target.replace("/", "--") + ".json")
        if not snap.exists():
            raise UserError(f"target {r.target}: config not reachable and no {snap} snapshot") from None
        raw = json.loads(snap.read_text())
        tc, origin = AutoConfig.for_model(raw.pop("model_type"), **raw), f"snapshot {snap.name}"
    cfg = Eagle3Config.for_target(tc, draft_vocab_size=r.vocab.draft_vocab_size, aux_layer_ids=r.head.aux_layer_ids)
    bad = [i for i in cfg.aux_layer_ids if not 0 <= i < tc.num_hidden_layers]
    if bad:
        raise UserError(f"head.aux_layer_ids {list(cfg.aux_layer_ids)}: {bad} outside 0..{tc.num_hidden_layers - 1}")
    if r.vocab.draft_vocab_size > tc.vocab_size:
        raise UserError(f"vocab.draft_vocab_size {r.vocab.draft_vocab_size} exceeds the target vocab {tc.vocab_size}")
    counts = _param_counts(cfg)
    info["head"] = {"config_from": origin, "trainable_params": sum(counts.values()),
                    "aux_layer_ids": list(cfg.aux_layer_ids), "draft_vocab_size": cfg.draft_vocab_size,
                    "rope": cfg.rope_parameters.get("rope_type", "default")}
    bpt = {"float32": 4, "bfloat16": 2, "float16": 2}[r.features.dtype] * 4 * tc.hidden_size + 4
    info["offline_feature_bytes_per_token"] = bpt
    print(json.dumps(info, indent=1))
    return info


def _param_counts(cfg) -> dict[str, int]:
    from tsengine.eagle3.format import expected_shapes

    out = {}
    for k, shape in expected_shapes(cfg).items():
        if k in ("d2t", "t2d", "embed_tokens.weight"):
            continue
        n = 1
        for d in shape:
            n *= d
        out[k] = n
    return out


def main(argv: list[str] | None = None) -> int:
    from tsengine.train.threads import use_machine_cores  # first: before torch's thread pool sizes itself
    use_machine_cores()
    p = argparse.ArgumentParser(prog="train_eagle3.py", description=__doc__.splitlines()[0])
    p.add_argument("--recipe", required=True, help="YAML recipe (recipes/*.yaml)")
    p.add_argument("--output-dir", help="run directory (overrides output_dir); the head lands in DIR/export")
    p.add_argument("--max-samples", type=int, help="use at most N training rows (quick runs)")
    p.add_argument("--max-steps", type=int, help="stop after N optimizer steps")
    p.add_argument("--dry-run", action="store_true", help="validate the recipe and exit")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=3e-4")
    args = p.parse_args(argv)

    def body() -> None:
        extra = {"output_dir": args.output_dir, "data.max_samples": args.max_samples, "train.max_steps": args.max_steps}
        r = recipes.load(args.recipe, args.overrides, **extra)
        sized = any(o.split("=", 1)[0].strip() in ("eval.num_prompts", "eval.max_new_tokens") for o in args.overrides)
        run(r, dry_run=args.dry_run, user_sized=sized)

    return run_main("train_eagle3", body)


if __name__ == "__main__":
    sys.exit(main())
