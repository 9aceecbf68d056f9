"""The training loop: accelerate (1 process, DDP on gloo/nccl, DeepSpeed ZeRO), TTT, checkpoints, resume.

Exact resume is a design goal, not a best effort: the batch plan is a pure function of (seed, epoch), the
model has no dropout, and a checkpoint holds model, optimizer, scheduler, every rank's RNG and the data
position, so a run killed with -9 and resumed logs the same loss sequence as one that never stopped.
Checkpoints are written into a temporary directory and renamed when complete; a directory without the
COMPLETE marker is never resumed from.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from tqdm import tqdm

from tsengine.train.features import Features, FeatureStore, TargetFeatures, lm_head_weight
from tsengine.train.loss import step_loss, teacher, valid_positions
from tsengine.train.recipe import Recipe
from tsengine.train.ttt import unroll
from tsengine.eagle3.head import Eagle3Head

COMPLETE = "COMPLETE"


# ---- data ---------------------------------------------------------------------------------------
def plan_batches(lengths: list[int], batch_tokens: int, seed: int, epoch: int, world: int = 1) -> list[list[list[int]]]:
    """Per rank, the epoch's micro-batches of example ids: similar lengths together (little padding),
    batch order shuffled by (seed, epoch), every rank the same number of batches."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * lengths[i] > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    random.Random(seed * 1000003 + epoch).shuffle(batches)
    per_rank = len(batches) // world
    return [batches[r * per_rank:(r + 1) * per_rank] for r in range(world)]


def collate(dataset, examples: list[int], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = [dataset[e] for e in examples]
    t = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), t, dtype=torch.long)
    att = torch.zeros(len(rows), t, dtype=torch.long)
    mask = torch.zeros(len(rows), t, dtype=torch.bool)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n], att[i, :n], mask[i, :n] = torch.tensor(r["input_ids"]), 1, torch.tensor(r["loss_mask"], dtype=torch.bool)
    return ids.to(device), att.to(device), mask.to(device)


# ---- the model the optimizer sees ---------------------------------------------------------------
class TTTModel(nn.Module):
    """The head plus the TTT unroll and loss, so DDP / DeepSpeed wrap one forward. The target's
    embeddings and draft lm_head rows are frozen constants here, not parameters (never synced or saved)."""

    def __init__(self, head: Eagle3Head, embed: torch.Tensor, target_lm_rows: torch.Tensor, steps: int,
                 decay: float, chunk: int):
        super().__init__()
        self.head = head
        self.steps, self.decay, self.chunk = steps, decay, chunk
        self.frozen = {"embed": embed.detach(), "rows": target_lm_rows.detach()}

    def forward(self, input_ids, loss_mask, aux, final, argmax):
        head = self.head
        hidden0 = head.project(aux.to(head.fc.weight.dtype))
        outs = unroll(head, self.frozen["embed"], hidden0, input_ids, self.steps)
        probs, where = teacher(final, self.frozen["rows"], loss_mask, argmax, head.t2d, self.chunk)
        total, stats = 0.0, []
        for k, out in enumerate(outs):
            valid = valid_positions(loss_mask, argmax, head.t2d, k)
            s = step_loss(head, out, valid, probs, where, k, self.chunk)
            total = total + (self.decay ** k) * s.loss
            stats.append(torch.stack([s.loss.detach() * s.valid, s.valid, s.correct]))
        return total, torch.stack(stats)  # stats[k] = (loss·n, n, correct)


@dataclass
class State:
    step: int = 0  # optimizer steps done
    epoch: int = 0
    batch: int = 0  # micro-batches of this epoch done
    best: float = -1.0
    tokens: int = 0  # trained-on tokens seen (all ranks)
    wall: float = 0.0  # training seconds before this process
    recipe_key: str = ""  # what the run was started with; resuming under another recipe is refused


def summarize(stats: torch.Tensor) -> dict[str, float]:
    """stats [steps, 3] summed -> loss_k, acc_k and the simulated acceptance length Σ_k Π_{j≤k} acc_j."""
    out, run, sim = {}, 1.0, 0.0
    for k, (ls, n, c) in enumerate(stats.tolist()):
        acc = c / n if n else 0.0
        out[f"loss_{k}"], out[f"acc_{k}"] = (ls / n if n else 0.0), acc
        run *= acc
        sim += run
    out["sim_accept_len"] = sim
    return out


def plot_acc(metrics_path: Path, out_png: Path) -> None:
    """acc_k per step (training and validation) as one PNG: the curve that tells whether to train longer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, split in zip(axes, ("train", "val")):
        pts = [r for r in rows if r.get("split") == split]
        k, win = 0, 20 if split == "train" else 1  # per-step training batches are small: smooth them
        while pts and f"acc_{k}" in pts[0]:
            ys = [r[f"acc_{k}"] for r in pts]
            ys = [sum(ys[max(0, i - win + 1):i + 1]) / len(ys[max(0, i - win + 1):i + 1]) for i in range(len(ys))]
            ax.plot([r["step"] for r in pts], ys, label=f"acc_{k}")
            k += 1
        ax.set_title(f"{split}: draft top-1 accuracy per TTT step" + (f" ({win}-step mean)" if win > 1 else ""))
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        if k:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def save_checkpoint(accelerator, model: TTTModel, state: State, out_root: Path, keep: int) -> Path:
    final = out_root / f"step-{state.step:08d}"
    tmp = out_root / f".step-{state.step:08d}.tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp), safe_serialization=True)
    accelerator.wait_for_everyone()  # every rank's RNG state is on disk before the marker says complete
    head = accelerator.unwrap_model(model).head
    if accelerator.is_main_process:
        save_file({k: v.detach().cpu().contiguous() for k, v in head.exported_state_dict().items()},
                  str(tmp / "head.safetensors"))
        (tmp / "head_config.json").write_text(json.dumps(head.config.to_hf_dict(), indent=1))
        (tmp / "trainer_state.json").write_text(json.dumps(state.__dict__))
        (tmp / COMPLETE).write_text("")
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        done = sorted(p for p in out_root.glob("step-*") if (p / COMPLETE).exists())
        for old in done[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def latest_checkpoint(out_root: Path) -> Path | None:
    done = sorted(p for p in out_root.glob("step-*") if (p / COMPLETE).exists())
    return done[-1] if done else None


def _deepspeed_launch() -> bool:
    import os

    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def _deepspeed_clipping(config: dict, grad_clip: float) -> None:
    """DeepSpeed clips inside its own step (accelerate's clip_grad_norm_ only reads the norm back) and
    accelerate fills an "auto" clip with 1.0: make the recipe's train.grad_clip the value it uses."""
    have = config.get("gradient_clipping", "auto")
    if have != "auto" and float(have) != grad_clip:
        from tsengine.errors import UserError

        raise UserError(f"DeepSpeed config gradient_clipping={have} differs from train.grad_clip={grad_clip}: set "
                        "it to \"auto\" (the recipe's value is used) or make them equal")
    config["gradient_clipping"] = grad_clip


class Trainer:
    def __init__(self, recipe: Recipe, head: Eagle3Head, target, train_data, val_data=None,
                 train_features: FeatureStore | None = None, val_features: FeatureStore | None = None):
        from accelerate import Accelerator
        from transformers import get_cosine_with_min_lr_schedule_with_warmup

        self.r, o = recipe, recipe.train
        mp = o.mixed_precision
        if mp == "auto":
            mp = "bf16" if torch.cuda.is_available() else "no"
        # cpu=True on a CPU machine, else torchrun runs unsynced copies; but under cpu=True accelerate drops
        # DeepSpeed without a word, so a DeepSpeed launch passes False (DeepSpeed's CPU accelerator: gloo).
        self.acc = Accelerator(mixed_precision=mp, gradient_accumulation_steps=o.grad_accum,
                               cpu=not torch.cuda.is_available() and not _deepspeed_launch())
        if self.acc.state.deepspeed_plugin is not None:
            _deepspeed_clipping(self.acc.state.deepspeed_plugin.deepspeed_config, o.grad_clip)
        dev = self.acc.device
        self.out = Path(recipe.output_dir)
        self.train_data, self.val_data = train_data, val_data
        self.train_features, self.val_features = train_features, val_features
        self.target = target.to(dev).eval().requires_grad_(False)
        self.features = TargetFeatures(self.target, head.config.aux_layer_ids)
        head = head.to(dev)
        rows = lm_head_weight(target)[torch.arange(head.config.draft_vocab_size, device=dev) + head.d2t]
        model = TTTModel(head, target.get_input_embeddings().weight, rows, o.ttt_steps, o.step_weight_decay,
                         o.loss_chunk_tokens)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)
        self.lengths = [len(x) for x in train_data["input_ids"]]
        per_epoch = len(plan_batches(self.lengths, o.batch_tokens, recipe.seed, 0, self.acc.num_processes)[0])
        if per_epoch < o.grad_accum:
            from tsengine.errors import UserError

            raise UserError(f"each of {self.acc.num_processes} process(es) gets {per_epoch} micro-batches per epoch, "
                            f"fewer than train.grad_accum={o.grad_accum}: use more data, smaller "
                            "train.batch_tokens or a smaller grad_accum")
        self.steps_per_epoch = per_epoch // o.grad_accum
        total = self.steps_per_epoch * o.epochs
        self.total_steps = min(total, o.max_steps) if o.max_steps else total
        # The scheduler is stepped by us once per optimizer step (not prepared: accelerate would step it
        # once per process) and registered so checkpoints carry it.
        self.sched = get_cosine_with_min_lr_schedule_with_warmup(
            opt, math.ceil(o.warmup_ratio * self.total_steps), self.total_steps, min_lr_rate=o.min_lr_ratio)
        self.model, self.opt = self.acc.prepare(model, opt)
        self.acc.unwrap_model(self.model).head.reset_rope()  # DeepSpeed bf16 casts buffers; RoPE stays fp32
        self.acc.register_for_checkpointing(self.sched)
        from tsengine.train.stages import digest

        self.state = State(recipe_key=digest(recipe.train.model_dump(mode="json", exclude={
            "checkpoint_every", "keep_checkpoints", "eval_every", "log_every"}), recipe.seed, len(self.lengths),
                                             sum(self.lengths), self.acc.num_processes))
        self.ckpt_root = self.out / "checkpoints"
        self.metrics = self.out / "metrics.jsonl"
        self.wandb = None

    # ---- features -------------------------------------------------------------------------------
    def _features(self, store: FeatureStore | None, examples, ids, att) -> Features:
        if store is None:
            return self.features(ids, att)
        f = store.batch(examples, ids.shape[1], self.target.dtype)
        return Features(f.aux.to(ids.device), f.final.to(ids.device), f.argmax.to(ids.device))

    def _forward(self, data, store, examples, model=None):
        ids, att, mask = collate(data, examples, self.acc.device)
        f = self._features(store, examples, ids, att)
        return (model or self.model)(ids, mask, f.aux, f.final, f.argmax), int(mask.sum())

    # ---- loop ---------------------------------------------------------------------------------------
    def resume(self) -> bool:
        ckpt = latest_checkpoint(self.ckpt_root)
        if ckpt is None:
            return False
        saved = State(**json.loads((ckpt / "trainer_state.json").read_text()))
        if saved.recipe_key != self.state.recipe_key:
            from tsengine.errors import UserError

            raise UserError(f"{ckpt} was written under other training settings (train.*, seed, data, processes); resume "
                            f"needs the same recipe: use another --output-dir or remove {self.ckpt_root}")
        self.acc.load_state(str(ckpt))
        self.state = saved
        if self.acc.is_main_process and self.metrics.exists():  # drop lines logged after that checkpoint
            keep = [x for x in self.metrics.read_text().splitlines() if json.loads(x)["step"] <= self.state.step]
            self.metrics.write_text("".join(k + "\n" for k in keep))
        self.acc.wait_for_everyone()
        return True

    def _log(self, row: dict) -> None:
        if not self.acc.is_main_process:
            return
        with self.metrics.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.wandb is not None:
            self.wandb.log({f"{row['split']}/{k}": v for k, v in row.items() if k not in ("split", "step")},
                           step=row["step"])

    def _init_wandb(self) -> None:
        if self.r.log.report_to != "wandb" or not self.acc.is_main_process:
            return
        import os

        import wandb

        mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
        self.wandb = wandb.init(project=self.r.log.project, name=self.r.log.run_name, dir=str(self.out),
                                mode=mode, config=self.r.model_dump(mode="json"), resume="allow")

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        if self.val_data is None:
            return {}
        # The unwrapped module: a rank may get no validation batch, and a DDP forward would start a
        # buffer broadcast the other ranks never join.
        model = self.acc.unwrap_model(self.model)
        model.eval()
        lengths = [len(x) for x in self.val_data["input_ids"]]
        total = None
        for examples in plan_batches(lengths, self.r.train.batch_tokens, 0, 0, 1)[0][self.acc.process_index::self.acc.num_processes]:
            with self.acc.autocast():
                (_, stats), _ = self._forward(self.val_data, self.val_features, examples, model)
            total = stats if total is None else total + stats
        if total is None:
            total = torch.zeros(self.r.train.ttt_steps, 3, device=self.acc.device)
        total = self.acc.reduce(total, reduction="sum")
        self.model.train()
        return summarize(total.cpu())

    def train(self) -> dict:
        o, st = self.r.train, self.state
        self.out.mkdir(parents=True, exist_ok=True)
        self._init_wandb()
        self.model.train()
        t0 = time.time() - st.wall
        bar = tqdm(total=self.total_steps, initial=st.step, desc="train", unit="step",
                   disable=not self.acc.is_local_main_process)
        window = None
        last_val = {}
        while st.step < self.total_steps:
            plan = plan_batches(self.lengths, o.batch_tokens, self.r.seed, st.epoch, self.acc.num_processes)
            mine = plan[self.acc.process_index]
            usable = min(self.steps_per_epoch * o.grad_accum, len(mine))
            while st.batch < usable and st.step < self.total_steps:
                with self.acc.accumulate(self.model):
                    (loss, stats), n_tok = self._forward(self.train_data, self.train_features, mine[st.batch])
                    self.acc.backward(loss)
                    window = stats if window is None else window + stats
                    st.tokens += n_tok * self.acc.num_processes
                    if self.acc.sync_gradients:
                        gnorm = self.acc.clip_grad_norm_(self.model.parameters(), o.grad_clip)
                    self.opt.step()
                    self.opt.zero_grad()
                st.batch += 1
                if not self.acc.sync_gradients:
                    continue
                self.sched.step()
                st.step += 1
                bar.update(1)
                s = summarize(self.acc.reduce(window, reduction="sum").cpu())
                window = None
                row = {"split": "train", "step": st.step, "epoch": st.epoch, "lr": self.sched.get_last_lr()[0],
                       "loss": float(loss.detach()), "grad_norm": float(gnorm) if gnorm is not None else None,
                       "tokens": st.tokens, "wall_s": round(time.time() - t0, 2), **s}
                self._log(row)
                if st.step % o.log_every == 0:
                    bar.set_postfix(loss=f"{row['loss']:.3f}", acc0=f"{s['acc_0']:.2f}")
                last = st.step == self.total_steps
                if st.step % o.eval_every == 0 or last:
                    last_val = self.evaluate()
                    if last_val:
                        self._log({"split": "val", "step": st.step, **last_val})
                        if last_val["sim_accept_len"] > st.best:
                            st.best = last_val["sim_accept_len"]
                            self._export_best()
                if st.step % o.checkpoint_every == 0 or last:
                    st.wall = time.time() - t0
                    save_checkpoint(self.acc, self.model, st, self.ckpt_root, o.keep_checkpoints)
            if st.batch >= usable:
                st.epoch, st.batch = st.epoch + 1, 0
        bar.close()
        if self.val_data is None:
            self._export_best()
        if self.acc.is_main_process and self.metrics.exists():
            plot_acc(self.metrics, self.out / "acc_k.png")
        if self.wandb is not None:
            self.wandb.finish()
        return {"steps": st.step, "tokens": st.tokens, "wall_s": round(time.time() - t0, 1), "best": st.best,
                **{f"val_{k}": v for k, v in last_val.items()}}

    def _export_best(self) -> None:
        """The best head so far (by validation simulated acceptance) in the interchange format."""
        from tsengine.eagle3.format import save_head

        if self.acc.is_main_process:
            head = self.acc.unwrap_model(self.model).head
            tmp = self.out / ".export.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            save_head(head, tmp)
            shutil.rmtree(self.out / "export", ignore_errors=True)
            tmp.rename(self.out / "export")
        self.acc.wait_for_everyone()
