"""The recipe's pipeline as one declared list of stages (`STAGES`), walked in order by `run`.

Every stage caches its products under DIR by its own inputs (train/stages.py), so walking the list again
redoes only what is not done. Every rank walks the same list, so barriers match; a stage says which ranks
do its work. Data stages run on rank 0 while the others wait (one writer per cached file), except where the
work divides: regeneration with capture gives each rank its share of the rows, and the feature dump and
training are data-parallel.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from tsengine.train.recipe import Recipe
from tsengine.train.splits import answer_rows_for, captures, regenerate, source_splits, subset, write_used

MAIN = "rank 0, the others wait"
FIRST = "rank 0 first, then the others"
EVERY = "every rank"

if TYPE_CHECKING:
    from accelerate import PartialState

    from tsengine.eagle3.config import Eagle3Config
    from tsengine.eagle3.head import Eagle3Head


@dataclass(frozen=True)
class Stage:
    name: str
    applies: Callable[[Recipe], bool]  # whether this run needs the stage
    body: Callable[[Run], None]
    produces: str  # under DIR, for the reader and for --dry-run
    ranks: Callable[[Recipe], str] = lambda r: MAIN  # MAIN, FIRST or EVERY


@dataclass
class Run:
    """What the stages hand on to each other. Ranks other than 0 never see the rows of a MAIN stage:
    everything after the data stages reads its inputs from DIR."""

    r: Recipe
    state: PartialState
    model: object  # the target, loaded once for every stage
    tok: object
    cfg: Eagle3Config  # the head's shape for this target
    user_sized: bool  # eval size given on the command line (train/evaluation.py)
    report: dict
    splits: dict = field(default_factory=dict)  # split -> the rows the next data stage works on
    head: Eagle3Head | None = None
    deadline: float | None = None  # time.time() at which training stops (a budgeted run: train/budget.py)

    @property
    def root(self) -> Path:
        return Path(self.r.output_dir)

    def prepared(self, split: str) -> Path:
        return self.root / "data" / "prepared" / split

    @cached_property
    def data(self) -> dict:
        from tsengine.train.prepare_data import load_prepared

        return {s: load_prepared(self.prepared(s)) for s in ("train", "val")}

    @cached_property
    def vocab_dir(self) -> Path:
        return Path((self.root / "vocab" / "current").read_text())

    @cached_property
    def stores(self) -> dict:
        """Offline features: dumped by a second target pass, or captured while regenerating."""
        if self.r.features.mode != "offline":
            return {"train": None, "val": None}
        from tsengine.train.features import FeatureStore

        where = "capture" if captures(self.r) else "features"
        return {s: FeatureStore(self.root / where / s) for s in ("train", "val")}


# ---- the stages, in the order they run ----------------------------------------------------------
def _rows(ctx: Run) -> None:
    train, val = source_splits(ctx.r, ctx.root)
    ctx.splits = {"train": train, "val": subset(val, ctx.r.data.max_val_samples, ctx.r.seed)}


def _regenerate(ctx: Run) -> None:
    ctx.splits = {s: regenerate(ctx.r, ctx.model, ctx.tok, answer_rows_for(ctx.r, rows, s),
                                ctx.root / "data" / "regen" / f"{s}.jsonl") for s, rows in ctx.splits.items()}


def _regenerate_capture(ctx: Run) -> None:
    from tsengine.train.capture import regenerate_share

    st, share = ctx.state, {}
    if st.num_processes > 1:  # each rank its own share on its own device; one process: the engine picks it
        share = {"rank": st.process_index, "world": st.num_processes, "device": str(st.device)}
    ctx.splits = {s: answer_rows_for(ctx.r, rows, s) for s, rows in ctx.splits.items()}
    for s, rows in ctx.splits.items():
        regenerate_share(ctx.r, ctx.tok, rows, s, ctx.root, ctx.cfg.aux_layer_ids, **share)


def _prepare(ctx: Run) -> None:
    from tsengine.train.prepare_data import prepare

    for s, rows in ctx.splits.items():
        prepare(ctx.tok, write_used(rows, ctx.root, s), ctx.prepared(s), ctx.r.data.max_length)


def _index_capture(ctx: Run) -> None:
    from tsengine.train.capture import finalize_split

    for s, rows in ctx.splits.items():
        finalize_split(ctx.r, ctx.tok, rows, s, ctx.root, ctx.cfg.aux_layer_ids)


def _vocab(ctx: Run) -> None:
    from tsengine.train.vocab import build_vocab

    vocab_dir = build_vocab(ctx.tok, ctx.prepared("train"), ctx.model.config.vocab_size,
                            ctx.r.vocab.draft_vocab_size, ctx.root / "vocab")
    (ctx.root / "vocab" / "current").write_text(str(vocab_dir))


def _dump_features(ctx: Run) -> None:
    from tsengine.train import dump_features

    r = ctx.r
    for s in ("train", "val"):
        dump_features.run(ctx.model, ctx.data[s], ctx.prepared(s), ctx.cfg.aux_layer_ids, ctx.root / "features" / s,
                          r.features.dtype, r.train.batch_tokens, r.features.shard_tokens, ctx.state,
                          target_name=r.target)


def _head(ctx: Run) -> None:
    """The untrained head, identical on every rank: seeded init, the vocab map, and where the recipe asks,
    lm_head from the target and fc columns scaled to the target's features (train/fc_init.py)."""
    import torch

    from tsengine.eagle3.head import Eagle3Head
    from tsengine.train.fc_init import sample_aux, scale_fc_columns
    from tsengine.train.features import TargetFeatures
    from tsengine.train.vocab import load_vocab

    r, model = ctx.r, ctx.model
    head = Eagle3Head(ctx.cfg)
    head.init_weights(r.seed, std=r.head.init_std)
    head.set_vocab_map(*load_vocab(ctx.vocab_dir))
    if r.head.lm_head_from_target:
        head.init_from_target(model)
    if r.head.fc_init == "scaled":
        data, store, feats = ctx.data["train"], ctx.stores["train"], TargetFeatures(model, head.config.aux_layer_ids)

        def aux_of(i: int):
            if store is not None:
                return store.get(i)[0]
            ids = torch.tensor([data[i]["input_ids"]], device=next(model.parameters()).device)
            return feats(ids, torch.ones_like(ids)).aux[0].cpu()

        scale_fc_columns(head.fc.weight, sample_aux(aux_of, [len(x) for x in data["input_ids"]]))
    ctx.head = head


def _train(ctx: Run) -> None:
    from tsengine.train.trainer import Trainer

    stores, report = ctx.stores, ctx.report
    if stores["train"] is not None:
        report["feature_bytes_per_token"] = stores["train"].meta["bytes_per_token"]
    if ctx.deadline is not None:
        ctx.r = _fit_to_deadline(ctx)
    trainer = Trainer(ctx.r, ctx.head, ctx.model, ctx.data["train"], ctx.data["val"], stores["train"], stores["val"])
    resumed = trainer.resume()
    report["resumed_from_step"] = trainer.state.step if resumed else None
    report["train"] = trainer.train(deadline=ctx.deadline)


def _fit_to_deadline(ctx: Run) -> Recipe:
    """A budgeted run's epochs re-fitted when training starts, to the time left before the deadline (the data
    stages may have run over or under their estimate). Rank 0 decides once and keeps it in plan.json, so
    every rank, and a relaunch resuming a checkpoint, trains the same schedule."""
    from tsengine.train import budget

    path = ctx.root / "plan.json"
    with ctx.state.main_process_first():
        saved = json.loads(path.read_text())
        if "fitted_epochs" not in saved and ctx.state.is_main_process:
            rates, answers = budget.Rates(**saved["rates"]), len(ctx.data["train"])
            left = ctx.deadline - time.time()
            saved["fitted_epochs"] = budget.fit_epochs(ctx.r.train.epochs, rates, answers, left)
            saved["fitted_at_s"] = round(time.time() - ctx.report["budget"]["start"], 1)
            path.write_text(json.dumps(saved, indent=1))
        saved = json.loads(path.read_text())
    if ctx.state.is_main_process and saved["fitted_epochs"] != ctx.r.train.epochs:
        print(f"budget: {saved['fitted_epochs']:g} epochs fit before the deadline (planned {ctx.r.train.epochs:g})",
              flush=True)
    ctx.report["budget"]["plan"] = saved
    fitted = ctx.r.model_copy(deep=True)
    fitted.train.epochs = saved["fitted_epochs"]
    return fitted


def _eval(ctx: Run) -> None:
    """τ of DIR/export, then the run's report: what each stage made and what it cost."""
    from tsengine.train.evaluation import evaluate

    root, report = ctx.root, ctx.report
    report["data"] = {s: json.loads((ctx.prepared(s) / "stage.json").read_text()) for s in ("train", "val")}
    report["vocab"] = json.loads((ctx.vocab_dir / "stage.json").read_text())
    for split in ("train", "val"):
        walls = [json.loads(p.read_text()) for p in sorted((root / "data" / "regen").glob(f"{split}.*wall.json"))]
        if walls:  # one file, or one per rank (ranks run side by side: the stage lasts the longest one)
            tokens = [w["tokens_out"] for w in walls]
            report.setdefault("regen", {})[split] = {"wall_s": max(w["wall_s"] for w in walls), "ranks": len(walls),
                                                     "tokens_out": None if None in tokens else sum(tokens)}
    report["eval"] = evaluate(ctx.r, ctx.model, ctx.tok, root, ctx.user_sized)
    if "budget" in report:  # plan beside actual: the whole run, eval included, against its budget
        b = report["budget"]
        b["actual_s"] = round(time.time() - b["start"], 1)
        b["within_budget"] = b["actual_s"] <= b["plan"]["plan"]["budget_s"]
    (root / "summary.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: report[k] for k in ("train", "eval") if k in report}, indent=1))


def _always(r: Recipe) -> bool:
    return True


STAGES = [
    # every rank needs its share of the rows when it captures; rank 0 writes the prompt files first
    Stage("data", _always, _rows, "the train/val rows; data/prompts/ for the built-in source",
          ranks=lambda r: FIRST if captures(r) else MAIN),
    Stage("regenerate", lambda r: r.data.regenerate and not captures(r), _regenerate, "data/regen/<split>.jsonl"),
    Stage("regenerate+capture", captures, _regenerate_capture, "capture/<split>/shard-*", ranks=lambda r: EVERY),
    Stage("prepare", lambda r: not captures(r), _prepare, "data/used/<split>.jsonl, data/prepared/<split>/"),
    Stage("index capture", captures, _index_capture, "data/prepared/<split>/, capture/<split>/index.json"),
    Stage("vocab", _always, _vocab, "vocab/<key>/ (d2t/t2d), vocab/current"),
    Stage("dump features", lambda r: r.features.mode == "offline" and not captures(r), _dump_features,
          "features/<split>/", ranks=lambda r: EVERY),
    Stage("head", _always, _head, "the untrained head (in memory)", ranks=lambda r: EVERY),
    # export/ is the best head by validation, so the loop writes it when validation improves: not a
    # stage after training, which only holds the last weights
    Stage("train", _always, _train, "checkpoints/step-N/, metrics.jsonl, acc_k.png, export/", ranks=lambda r: EVERY),
    Stage("eval", _always, _eval, "eval.json, summary.json"),
]


def plan(r: Recipe) -> list[str]:
    """The stages this recipe runs, one line each: what --dry-run prints."""
    return [f"{s.name} -> {s.produces} [{s.ranks(r)}]" for s in STAGES if s.applies(r)]


def _walk(stage: Stage, ctx: Run) -> None:
    where, state = stage.ranks(ctx.r), ctx.state
    if where == FIRST:
        with state.main_process_first():
            stage.body(ctx)
        return
    if where == EVERY or state.is_main_process:
        stage.body(ctx)
    state.wait_for_everyone()  # the stage's products are complete before any rank reads them


def run(r: Recipe, dry_run: bool = False, user_sized: bool = False) -> dict:
    """`user_sized`: the eval's size was set on the command line (train/evaluation.py)."""
    from datetime import timedelta

    import torch
    from accelerate import PartialState

    from tsengine.eagle3.config import Eagle3Config

    # Data stages and the final eval run on rank 0 while the others wait at a barrier: a long collective
    # timeout, or NCCL's 10-minute watchdog kills the waiting ranks during regeneration.
    state = PartialState(cpu=not torch.cuda.is_available(), timeout=timedelta(hours=24))
    if dry_run:
        from tsengine.train.dry_run import dry

        return dry(r, plan(r))
    from tsengine.targets import load_target

    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    model, tok = load_target(r.target, dtype=dtype, device=str(state.device))
    cfg = Eagle3Config.for_target(model.config, draft_vocab_size=r.vocab.draft_vocab_size,
                                  aux_layer_ids=r.head.aux_layer_ids)
    start = time.time()
    ctx = Run(r, state, model, tok, cfg, user_sized, report={})
    if r.budget_minutes is not None:
        r = ctx.r = _budgeted(ctx, start)
    ctx.report["recipe"] = r.model_dump(mode="json")
    ctx.report["precision"] = {"regen": r.regen.engine_dtype(), "train": r.train.precision()}  # "auto" resolved
    stage_s = ctx.report.setdefault("stage_s", {})  # what each stage took (the eval's entry is written after it)
    for stage in STAGES:
        if stage.applies(r):
            t0 = time.time()
            _walk(stage, ctx)
            stage_s[stage.name] = round(time.time() - t0, 1)
    return ctx.report


def _budgeted(ctx: Run, start: float) -> Recipe:
    """The recipe with its data and epochs sized to its budget on this machine (train/budget.py): planned
    once by rank 0 (kept in DIR/plan.json, so a relaunch keeps the size and its caches), read by the others."""
    from tsengine.model.precision import bf16_units, default_device
    from tsengine.train import budget

    r, root, path = ctx.r, ctx.root, ctx.root / "plan.json"
    budget_s = r.budget_minutes * 60
    with ctx.state.main_process_first():
        plan = budget.load(path, budget_s)
        if plan is None and ctx.state.is_main_process:
            unsized = r.model_copy(deep=True)
            unsized.data.max_samples = None
            train, val = source_splits(unsized, root)
            val = subset(val, r.data.max_val_samples, r.seed)
            rates = budget.measure(r, ctx.tok, train, ctx.cfg, ctx.model, root / "budget-probe")
            # a size the user set (data.max_samples, --max-samples) caps the prompts and is never grown
            cap = r.data.max_samples
            plan = budget.size(budget_s, rates, available_rows=len(train) if cap is None else min(cap, len(train)),
                               epochs=r.train.epochs, val_rows=len(val), answers=budget.answers_per_prompt(r.regen),
                               grow=cap is None)
            budget.save(plan, rates, path)
        plan = plan or budget.load(path, budget_s)
    if ctx.state.is_main_process:
        print(f"plan: {plan.describe()}; regeneration in {r.regen.engine_dtype()}, training precision "
              f"{r.train.precision()} (this {default_device()}'s bf16 unit: {bf16_units() or 'none'})", flush=True)
    sized = r.model_copy(deep=True)
    sized.data.max_samples = plan.rows
    sized.regen = budget.sized_regen(r.regen, plan.answers)
    sized.train.epochs = plan.epochs
    ctx.deadline = start + plan.train_deadline_s
    ctx.report["budget"] = {"plan": json.loads(path.read_text()), "start": start}
    return sized
