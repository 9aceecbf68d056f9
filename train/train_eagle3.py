"""Distill an EAGLE-3 head: run every stage the recipe needs that is not done yet, train, export, evaluate.

    accelerate launch train/train_eagle3.py --recipe recipes/smollm2-135m.yaml [key.sub=value ...]
        [--output-dir DIR] [--max-samples N] [--max-steps N] [--dry-run]

Stages (each cached under DIR, keyed by its inputs): prompts/data -> regenerate (target answers) ->
prepare (tokens + loss mask) -> vocab (d2t/t2d) -> [dump features, offline mode] -> train -> export
(DIR/export) -> eval (DIR/eval.json). Without `accelerate launch` it runs as one process. Data stages run
on rank 0 while the other ranks wait; training and feature dumps are data-parallel.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # `python train/train_eagle3.py`: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from train import recipe as recipes  # noqa: E402
from tsengine.errors import UserError, run_main  # noqa: E402


def _source_splits(r, root: Path) -> tuple[list, list]:
    """(train, val) rows: the built-in collection, or the user's data with a held-out 5% (at least one
    row). Every row gets an `id` (its own, else its index in the file), which names it in later stages."""
    import hashlib

    from train.data import load_rows
    from train.regenerate import row_id

    def rows_of(source: str, split: str) -> list:
        return [{**row, "id": row_id(row, i)} for i, row in enumerate(load_rows(source, split))]

    if r.data.source == "builtin":
        from train.prompts import write_jsonl

        paths = write_jsonl(root / "data" / "prompts")
        return rows_of(str(paths[0]), "train"), rows_of(str(paths[1]), "train")
    rows = rows_of(r.data.source, r.data.split)
    if r.data.val_source:
        return rows, rows_of(r.data.val_source, r.data.val_split)
    pick = [int(hashlib.sha256(x["id"].encode()).hexdigest()[:8], 16) % 20 == 0 for x in rows]
    if not any(pick) and len(rows) > 1:
        pick[-1] = True
    if len(rows) < 2 or all(pick):
        raise UserError(f"data {r.data.source}: {len(rows)} row(s) cannot be split into train and validation; "
                        "give more rows or data.val_source")
    return [x for x, p in zip(rows, pick) if not p], [x for x, p in zip(rows, pick) if p]


def _used(r, model, tok, rows: list, split: str, root: Path, limit: int | None) -> Path:
    """The rows this run trains on (a seeded subset when limited), with regenerated answers if asked,
    written to data/used/<split>.jsonl: the input of the prepare stage."""
    rows = _subset(rows, limit, r.seed)
    if r.data.regenerate:
        out = root / "data" / "regen" / f"{split}.jsonl"
        _regenerate(r, model, tok, rows, out)
        want = {x["id"] for x in rows}
        rows = [x for x in map(json.loads, out.read_text().splitlines()) if x["id"] in want]
    used = root / "data" / "used" / f"{split}.jsonl"
    used.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(x, ensure_ascii=False, default=str) + "\n" for x in rows)
    if not used.exists() or used.read_text() != text:  # same bytes keep the prepared data's cache key
        used.write_text(text)
    return used


def _regenerate(r, model, tok, rows: list, out: Path) -> None:
    """Answers are cached by row id across runs: a larger max_samples only adds rows; other
    regeneration settings (or another source) start over."""
    from train.regenerate import Regenerator

    settings = {"source": r.data.source, **r.regen.model_dump()}
    side = out.with_suffix(".settings.json")
    if side.exists() and json.loads(side.read_text()) != settings:
        out.unlink(missing_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    side.write_text(json.dumps(settings))
    g = r.regen
    t0 = time.time()
    skipped = Regenerator(model, tok, g.batch_size, g.max_new_tokens, g.temperature, g.top_p, g.seed).run(rows, out)
    if skipped.reasons:
        print(f"regenerate: {skipped.summary(len(rows) - sum(skipped.reasons.values()))}")
    log = out.with_suffix(".wall.json")
    prev = json.loads(log.read_text())["wall_s"] if log.exists() else 0.0
    log.write_text(json.dumps({"wall_s": round(prev + time.time() - t0, 1)}))


def _subset(rows: list, limit: int | None, seed: int) -> list:
    """`limit` rows spread over the whole file (seeded), not its first ones: files are often grouped."""
    if limit is None or limit >= len(rows):
        return rows
    import random

    keep = sorted(random.Random(seed).sample(range(len(rows)), limit))
    return [rows[i] for i in keep]


def run(r, dry_run: bool = False) -> dict:
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
    with state.main_process_first():
        if state.is_main_process:
            from train.prepare_data import prepare
            from train.vocab import build_vocab

            splits = dict(zip(("train", "val"), _source_splits(r, root)))
            limits = {"train": r.data.max_samples, "val": r.data.max_val_samples}
            for split, rows in splits.items():
                used = _used(r, model, tok, rows, split, root, limits[split])
                prepared[split] = prepare(tok, used, root / "data" / "prepared" / split, r.data.max_length)
            vocab_dir = build_vocab(tok, prepared["train"], model.config.vocab_size, r.vocab.draft_vocab_size,
                                    root / "vocab")
            (root / "vocab" / "current").write_text(str(vocab_dir))
    from train.prepare_data import load_prepared
    from train.vocab import load_vocab

    prepared = {s: root / "data" / "prepared" / s for s in ("train", "val")}
    vocab_dir = Path((root / "vocab" / "current").read_text())
    data = {s: load_prepared(p) for s, p in prepared.items()}
    cfg = Eagle3Config.for_target(model.config, draft_vocab_size=r.vocab.draft_vocab_size,
                                  aux_layer_ids=r.head.aux_layer_ids)
    from tsengine.eagle3.head import Eagle3Head

    head = Eagle3Head(cfg)
    head.init_weights(r.seed, std=r.head.init_std)
    head.set_vocab_map(*load_vocab(vocab_dir))
    if r.head.lm_head_from_target:
        head.init_from_target(model)
    stores = {"train": None, "val": None}
    if r.features.mode == "offline":
        from train import dump_features
        from train.features import FeatureStore

        for s in ("train", "val"):
            out = root / "features" / s
            dump_features.run(model, data[s], prepared[s], cfg.aux_layer_ids, out, r.features.dtype,
                              r.train.batch_tokens, r.features.shard_tokens, state, target_name=r.target)
            stores[s] = FeatureStore(out)
        report["feature_bytes_per_token"] = stores["train"].meta["bytes_per_token"]
    if r.head.fc_init == "scaled":
        _scale_fc(head, model, data["train"], stores["train"])
    from train.trainer import Trainer

    trainer = Trainer(r, head, model, data["train"], data["val"], stores["train"], stores["val"])
    resumed = trainer.resume()
    report["resumed_from_step"] = trainer.state.step if resumed else None
    report["train"] = trainer.train()
    if state.is_main_process:
        report["data"] = {s: json.loads((p / "stage.json").read_text()) for s, p in prepared.items()}
        report["vocab"] = json.loads((vocab_dir / "stage.json").read_text())
        for split in ("train", "val"):
            wall = root / "data" / "regen" / f"{split}.wall.json"
            if wall.exists():
                report.setdefault("regen_wall_s", {})[split] = json.loads(wall.read_text())["wall_s"]
        report["eval"] = _eval(r, model, tok, root)
        (root / "summary.json").write_text(json.dumps(report, indent=1))
        print(json.dumps({k: report[k] for k in ("train", "eval") if k in report}, indent=1))
    state.wait_for_everyone()
    return report


def _eval(r, model, tok, root: Path) -> dict:
    """τ of the exported head on validation prompts (the split's own prompts, not the regenerated answers)."""
    from infer.eval import evaluate, prompts_from, table
    from tsengine.eagle3.format import load_head

    head = load_head(root / "export", target=model.config, embeddings=model.get_input_embeddings().weight,
                     dtype=next(model.parameters()).dtype)
    src = root / "data" / "prepared" / "val" / "stage.json"
    val_rows = json.loads(src.read_text())["source"]
    shapes = [r.eval.chain] + ([r.eval.tree] if r.eval.tree else [])
    t0 = time.time()
    res = evaluate(model.float() if model.device.type == "cpu" else model, tok, head,
                   prompts_from(val_rows, tok, r.eval.num_prompts), shapes, r.eval.max_new_tokens)
    print(table(res))
    (root / "eval.json").write_text(json.dumps(res, indent=1))
    return {k: {"tau": v["tau"], "tokens": v["tokens"], "verify_steps": v["verify_steps"]} for k, v in res.items()} | {
        "wall_s": round(time.time() - t0, 1)}


def _scale_fc(head, model, data, store) -> None:
    """fc columns scaled from a sample of target features (train/fc_init.py); same on every rank."""
    import torch

    from train.fc_init import sample_aux, scale_fc_columns
    from train.features import TargetFeatures

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
        run(r, dry_run=args.dry_run)

    return run_main("train_eagle3", body)


if __name__ == "__main__":
    sys.exit(main())
