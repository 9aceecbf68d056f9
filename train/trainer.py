"""The training loop: accelerate (1 process, DDP on gloo/nccl, DeepSpeed ZeRO), TTT, resume.

Exact resume is a design goal, not a best effort: the batch plan is a pure function of (seed, epoch)
(train/batching.py), the model has no dropout, and a checkpoint holds everything else that moves
(train/checkpoints.py), so a run killed with -9 and resumed logs the same loss sequence as one that never
stopped.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from tsengine.eagle3.head import Eagle3Head
from tsengine.train.batching import collate, plan_batches
from tsengine.train.checkpoints import State, load_checkpoint, save_checkpoint
from tsengine.train.features import Features, FeatureStore, TargetFeatures, lm_head_weight
from tsengine.train.loss import step_loss, teacher, valid_positions
from tsengine.train.plots import plot_acc
from tsengine.train.recipe import Recipe
from tsengine.train.ttt import unroll


# ---- the model the optimizer sees ---------------------------------------------------------------
class TTTModel(nn.Module):
    """The head plus the TTT unroll and loss, so DDP / DeepSpeed wrap one forward. The target's
    embeddings and draft lm_head rows are frozen constants here, not parameters (never synced or saved).

    `aligned` (GRIFFIN's token-alignable training, arXiv 2502.11018): while training, step k learns only at
    the bases where steps 0..k-1 drafted the target's token, the only bases where a chain ever reaches step
    k; validation scores every base either way, so its acc_k compare across recipes."""

    def __init__(self, head: Eagle3Head, embed: torch.Tensor, target_lm_rows: torch.Tensor, steps: int,
                 decay: float, chunk: int, aligned: bool = False):
        super().__init__()
        self.head = head
        self.steps, self.decay, self.chunk, self.aligned = steps, decay, chunk, aligned
        self.frozen = {"embed": embed.detach(), "rows": target_lm_rows.detach()}

    def forward(self, input_ids, loss_mask, aux, final, argmax):
        head = self.head
        hidden0 = head.project(aux.to(head.fc.weight.dtype))
        outs = unroll(head, self.frozen["embed"], hidden0, input_ids, self.steps)
        probs, where = teacher(final, self.frozen["rows"], loss_mask, argmax, head.t2d, self.chunk)
        total, stats, reached = 0.0, [], None
        for k, out in enumerate(outs):
            valid = valid_positions(loss_mask, argmax, head.t2d, k)
            if reached is not None:
                valid = valid & reached.view_as(valid)
            s = step_loss(head, out, valid, probs, where, k, self.chunk)
            if self.aligned and self.training:
                reached = s.hits if reached is None else reached & s.hits
            total = total + (self.decay ** k) * s.loss
            stats.append(torch.stack([s.loss.detach() * s.valid, s.valid, s.correct]))
        return total, torch.stack(stats)  # stats[k] = (loss·n, n, correct)


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
        mp = o.precision()
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
                         o.loss_chunk_tokens, o.aligned_steps)
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
        total = max(1, round(self.steps_per_epoch * o.epochs))
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
        saved = load_checkpoint(self.acc, self.ckpt_root, self.state.recipe_key)
        if saved is None:
            return False
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
        batches = plan_batches(lengths, self.r.train.batch_tokens, 0, 0, 1)[0]
        for examples in batches[self.acc.process_index::self.acc.num_processes]:
            with self.acc.autocast():
                (_, stats), _ = self._forward(self.val_data, self.val_features, examples, model)
            total = stats if total is None else total + stats
        if total is None:
            total = torch.zeros(self.r.train.ttt_steps, 3, device=self.acc.device)
        total = self.acc.reduce(total, reduction="sum")
        self.model.train()
        return summarize(total.cpu())

    def train(self, deadline: float | None = None) -> dict:
        """Train to the recipe's last step, or until `deadline` (a `time.time()`): the step that reaches it
        is the last, validated, exported if best and checkpointed like the recipe's last step, so a run
        stopped by its budget (train/budget.py) loses nothing it trained."""
        o, st = self.r.train, self.state
        self.out.mkdir(parents=True, exist_ok=True)
        self._init_wandb()
        self.model.train()
        t0 = time.time() - st.wall
        bar = tqdm(total=self.total_steps, initial=st.step, desc="train", unit="step",
                   disable=not self.acc.is_local_main_process)
        window = None
        last_val, stopped = {}, "steps"
        while st.step < self.total_steps and stopped == "steps":
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
                if deadline is not None and self._reached(deadline):
                    stopped = "budget"
                last = st.step == self.total_steps or stopped == "budget"
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
                if stopped == "budget":
                    break
            if st.batch >= usable:
                st.epoch, st.batch = st.epoch + 1, 0
        bar.close()
        if self.val_data is None:
            self._export_best()
        if self.acc.is_main_process and self.metrics.exists():
            plot_acc(self.metrics, self.out / "acc_k.png")
        if self.wandb is not None:
            self.wandb.finish()
        return {"steps": st.step, "planned_steps": self.total_steps, "stopped_by": stopped, "tokens": st.tokens,
                "wall_s": round(time.time() - t0, 1), "best": st.best, **{f"val_{k}": v for k, v in last_val.items()}}

    def _reached(self, deadline: float) -> bool:
        """Whether any rank has reached `deadline`: every rank stops after the same step (one small
        collective per step, only on budgeted runs)."""
        late = torch.tensor([float(time.time() >= deadline)], device=self.acc.device)
        return bool(self.acc.reduce(late, reduction="max").item())

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
