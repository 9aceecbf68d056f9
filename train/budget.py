"""A recipe sized by its budget (`budget_minutes`): as much data as this machine can regenerate and train on
in the time, the eval included, instead of a fixed size that wastes the hour on a fast machine and overruns
it on a slow one.

Before any data stage, the run measures this machine (`measure`: one batch of rows answered by the engine in
the dtype the regenerate stage will use, the training step in the precision the trainer will use), sizes the
data with `size` and prints the plan. Order of what the time buys, from the data ablation
(docs/benchmarks.md): every prompt the source has, then sampled answers of those prompts (a sampled answer
of a known prompt was worth about a greedy answer of a new one), then epochs. The plan is kept in
DIR/plan.json, so a resumed run keeps its size and its caches. Training then stops at the plan's deadline
whatever the estimate said (`Trainer.train(deadline=...)`: the step that reaches it is validated and
exported if best), and summary.json puts the plan beside what each stage took.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from tsengine.errors import UserError

MIN_ROWS = 8  # fewer training rows than this is no recipe: the budget is refused
MAX_EPOCH_FACTOR = 4  # time left after all the rows buys at most this many times the recipe's epochs
MAX_ANSWERS = 4  # answers per prompt the budget may plan (the ablation measured up to 3)
SAMPLE_TEMPERATURE = 0.7  # the sampled answers' temperature when the recipe's answers are greedy (the ablation's)
SLACK = 0.9  # the share of the budget the plan fills: model loads, the vocab, start-up and misestimates
EVAL_START_S = 30.0  # an eval shape's engine start and its oracle prompts (the eval runs eagerly: no compiles)
SPEC_OVERHEAD = 1.5  # an eval shape's time per token against plain decoding's, for a weak head (pessimistic)
# the loop's validation passes, checkpoints, logging and feature reads on top of its probed steps: measured
# 1.39 on the budgeted hour (docs/benchmarks.md, 1,777 s trained against 1,467 s planned at 1.15)
TRAIN_OVERHEAD = 1.4


@dataclass(frozen=True, kw_only=True)
class Rates:
    """This machine's speeds, measured by `measure` (or given, in tests)."""

    regen_s_per_answer: float  # seconds to regenerate one answer (with its features, when captured)
    tokens_per_answer: float  # trained-on (assistant) tokens one answer gives
    train_s_per_answer: float  # seconds of training one answer costs per epoch (its share of the micro-batches)
    eval_s: float  # the final eval's expected seconds
    probe_s: float = 0.0  # what measuring took (spent from the budget)


@dataclass(frozen=True, kw_only=True)
class Plan:
    budget_s: float
    rows: int  # training prompts answered and trained on (data.max_samples)
    answers: int  # answers per prompt: the recipe's, or more (greedy + sampled) when every prompt fits
    epochs: float  # the last may be a fraction: the time the whole answers could not use
    expected_s: dict[str, float]  # stage -> seconds: probe, regenerate, train, eval
    train_deadline_s: float  # seconds after the run's start at which training stops
    tokens: float = 0.0  # expected trained-on tokens

    def describe(self) -> str:
        e = self.expected_s
        answers = f" x {self.answers} answers" if self.answers > 1 else ""
        return (f"budget {self.budget_s / 60:.1f} min: {self.rows} training prompts{answers} x {self.epochs:g} epochs"
                f" (~{self.tokens / 1000:.0f}k trained-on tokens); expected "
                + ", ".join(f"{k} {v / 60:.1f} min" for k, v in e.items())
                + f"; training stops by minute {self.train_deadline_s / 60:.1f}")


def size(budget_s: float, rates: Rates, *, available_rows: int, epochs: float, val_rows: int,
         answers: int = 1, grow: bool = True) -> Plan:
    """The most training prompts the budget holds with the recipe's `answers` per prompt at its epochs (the
    validation prompts are answered too, once each); if every prompt fits and `grow`, more answers per prompt
    (up to MAX_ANSWERS), then more epochs (up to MAX_EPOCH_FACTOR times the recipe's, in tenths: whole
    answers leave time over, and a fraction of an epoch is a shorter last pass) with the time left.
    Refuses a budget that holds fewer than MIN_ROWS prompts, naming the smallest that would do."""
    fixed = rates.probe_s + rates.eval_s + val_rows * rates.regen_s_per_answer
    spend = budget_s * SLACK - fixed
    per_answer = rates.regen_s_per_answer + epochs * rates.train_s_per_answer
    rows = min(available_rows, math.floor(spend / (answers * per_answer)))
    if rows < min(MIN_ROWS, available_rows):
        need = (fixed + MIN_ROWS * answers * per_answer) / SLACK
        raise UserError(f"budget_minutes={budget_s / 60:g}: this machine would regenerate and train fewer than "
                        f"{MIN_ROWS} rows in it (regeneration {rates.regen_s_per_answer:.1f} s an answer, training "
                        f"{rates.train_s_per_answer:.2f} s an answer an epoch, eval {rates.eval_s:.0f} s); "
                        f"allowed: at least {math.ceil(need / 60)}")
    if rows == available_rows and grow:  # every prompt fits: the time left buys answers, then epochs
        answers = max(answers, min(MAX_ANSWERS, math.floor(spend / (rows * per_answer))))
        left = spend - rows * answers * rates.regen_s_per_answer
        epochs = max(epochs, min(epochs * MAX_EPOCH_FACTOR,
                                 math.floor(10 * left / (rows * answers * rates.train_s_per_answer)) / 10))
    regen_s = (rows * answers + val_rows) * rates.regen_s_per_answer
    train_s = rows * answers * epochs * rates.train_s_per_answer
    expected = {"probe": rates.probe_s, "regenerate": regen_s, "train": train_s, "eval": rates.eval_s}
    return Plan(budget_s=budget_s, rows=rows, answers=answers, epochs=epochs,
                expected_s={k: round(v, 1) for k, v in expected.items()},
                train_deadline_s=budget_s - rates.eval_s - (1 - SLACK) * budget_s / 2,
                tokens=round(rows * answers * rates.tokens_per_answer))


def fit_epochs(planned: float, rates: Rates, answers: int, left_s: float) -> float:
    """The epochs that fit the `left_s` seconds before the deadline at the measured training rate, never more
    than `planned` (in tenths, at least one tenth): a regeneration that ran over its estimate shortens
    training by its schedule, so the learning rate still anneals where training ends."""
    per_epoch = answers * rates.train_s_per_answer
    return min(planned, max(0.1, math.floor(10 * left_s / per_epoch) / 10)) if per_epoch > 0 else planned


def answers_per_prompt(regen) -> int:
    """The recipe's own answers per prompt row (train/splits.answer_rows_for)."""
    return regen.samples_per_prompt + regen.include_greedy if regen.temperature > 0 else 1


def sized_regen(regen, answers: int):
    """`regen` with `answers` per prompt: the greedy answer (when the recipe's are greedy) and sampled ones."""
    if answers == answers_per_prompt(regen):
        return regen
    greedy = regen.temperature == 0 or regen.include_greedy
    return regen.model_copy(update={"temperature": regen.temperature or SAMPLE_TEMPERATURE,
                                    "include_greedy": greedy, "samples_per_prompt": answers - greedy})


def save(plan: Plan, rates: Rates, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"plan": asdict(plan), "rates": asdict(rates)}, indent=1))
    tmp.replace(path)


def load(path: Path, budget_s: float) -> Plan | None:
    """The plan an earlier launch of this run made for the same budget, or None."""
    if not path.exists():
        return None
    saved = json.loads(path.read_text())["plan"]
    current = saved["budget_s"] == budget_s and set(saved) == {f.name for f in fields(Plan)}
    return Plan(**saved) if current else None  # another budget, or a plan of an older version: plan anew


def measure(r, tok, train_rows: list, cfg, model, probe_dir: Path) -> Rates:
    """This machine's speeds: one batch of the training rows (`regen.batch_size`, at most 64) answered by the
    engine as the regenerate stage will (its dtype included), then the recipe's training step, in the
    trainer's precision, timed on a micro-batch of the typical shape (the batch plan of every row at its
    prompt's length plus the probe's mean answer); the eval's seconds from the decode speed."""
    from tsengine.train.batching import plan_batches
    from tsengine.train.splits import captures

    t0 = time.time()
    g, o = r.regen, r.train
    layer_ids = tuple(cfg.aux_layer_ids) if captures(r) else None
    regen_s, answer_tokens = _regen_probe(r, tok, train_rows[:min(64, g.batch_size)], probe_dir, layer_ids)
    lengths = [min(r.data.max_length, p + round(answer_tokens)) for p in _prompt_tokens(tok, train_rows)]
    batches = plan_batches(lengths, o.batch_tokens, r.seed, 0)[0]
    typical = sorted(batches, key=len)[len(batches) // 2]
    step_s = _train_probe(r, model, cfg, len(typical), max(lengths[i] for i in typical), answer_tokens)
    e = r.eval
    shapes = 2 if e.tree else 1  # each shape decodes all its prompts as one batch (infer/eval.py)
    s_per_token = regen_s / max(1.0, answer_tokens) * _eval_slowdown(g.engine_dtype())
    eval_s = shapes * (e.num_prompts * e.max_new_tokens * s_per_token * SPEC_OVERHEAD + EVAL_START_S)
    batches_per_answer = len(batches) / max(1, len(lengths))  # micro-batches (each one timed step) per answer
    return Rates(regen_s_per_answer=regen_s, tokens_per_answer=answer_tokens,
                 train_s_per_answer=batches_per_answer * step_s * TRAIN_OVERHEAD, eval_s=round(eval_s, 1),
                 probe_s=round(time.time() - t0, 1))


def _eval_slowdown(regen_dtype: str) -> float:
    """The eval serves the target in its own dtype (fp32 here): a bf16 regeneration probe decodes faster than
    the eval will (measured ~1.8x on an AMX CPU; docs/benchmarks.md)."""
    return 2.0 if regen_dtype == "bfloat16" else 1.0


def _prompt_tokens(tok, rows: list) -> list[int]:
    """Each row's prompt length in tokens, through the target's chat template (a row that fails it: 0)."""
    from tsengine.conversations import normalize

    out = []
    for x in rows:
        try:
            msgs = [m for m in normalize(x, require_assistant=False) if m["role"] != "assistant"]
            out.append(len(tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)))
        except Exception:  # the regenerate stage reports such rows; here they only cost nothing
            out.append(0)
    return out


def _regen_probe(r, tok, rows: list, probe_dir: Path, layer_ids: tuple[int, ...] | None) -> tuple[float, float]:
    """(seconds an answer, tokens an answer) of the engine answering `rows` at the recipe's batch size as the
    regenerate stage will: its features captured (`layer_ids`, when the recipe captures), and, where the
    recipe's answers are greedy, half of the rows sampled at SAMPLE_TEMPERATURE as the answers the budget may
    add (on the hour's run, sampling and capture made a token ~35% dearer than the greedy probe without
    capture priced it). Steady state: a step that compiled a graph is priced as a typical step (the run
    compiles each shape once; a probe of a few rows would be mostly compiles)."""
    import shutil
    import statistics

    from tsengine.targets import resolve
    from tsengine.train.features import ShardWriter
    from tsengine.train.regen_engine import EngineRegenerator
    from tsengine.train.regenerate import answer_rows

    g = r.regen
    shutil.rmtree(probe_dir, ignore_errors=True)
    if g.backend == "openai":  # the servers answer: their wall time per answer is the rate
        from tsengine.train.regen_openai import OpenAIRegenerator

        server = OpenAIRegenerator(g.base_urls, g.model, g.batch_size, g.max_new_tokens, g.top_p, g.seed)
        t0 = time.perf_counter()
        server.run(answer_rows(rows, g.temperature), probe_dir / "probe.jsonl", progress=False)
        shutil.rmtree(probe_dir, ignore_errors=True)
        return (time.perf_counter() - t0) / max(1, len(rows)), server.tokens_out / max(1, len(rows))
    regen = EngineRegenerator(resolve(r.target), tok, min(g.batch_size, len(rows)), g.max_new_tokens, g.top_p,
                              g.seed, r.data.max_length, layer_ids, dtype=g.engine_dtype())
    half = len(rows) // 2
    todo = (answer_rows(rows[:half], 0.0) + answer_rows(rows[half:], SAMPLE_TEMPERATURE) if g.temperature == 0
            else answer_rows(rows, g.temperature))
    engine, steps = regen.engine, []
    step = engine.step

    def timed_step():
        before, t0 = engine.snapshot().compiled_graphs, time.perf_counter()
        out = step()
        steps.append((time.perf_counter() - t0, engine.snapshot().compiled_graphs != before))
        return out

    engine.step = timed_step
    if layer_ids:
        writer = ShardWriter(probe_dir, "probe", "shard", r.features.dtype, r.features.shard_tokens)
        regen.run(todo, writer=writer, progress=False)
    else:
        regen.run(todo, out_path=probe_dir / "probe.jsonl", progress=False)
    warm = [t for t, compiled in steps if not compiled]
    seconds = sum(warm) + (statistics.median(warm) if warm else 0.0) * (len(steps) - len(warm))
    shutil.rmtree(probe_dir, ignore_errors=True)
    return seconds / max(1, len(todo)), regen.tokens_out / max(1, len(todo))


def _train_probe(r, model, cfg, rows: int, length: int, answer_tokens: float, steps: int = 3) -> float:
    """Seconds of the recipe's training step (TTT unroll, loss, backward, AdamW; the target's forward too in
    online mode) on a [rows, length] micro-batch of random features of the target's shape, on the CPU in the
    trainer's precision there."""
    import torch

    from tsengine.eagle3.head import Eagle3Head
    from tsengine.train.features import lm_head_weight
    from tsengine.train.trainer import TTTModel

    o = r.train
    head = Eagle3Head(cfg)
    head.init_weights(0)
    v = cfg.draft_vocab_size
    head.set_vocab_map(torch.zeros(v, dtype=torch.long), torch.arange(model.config.vocab_size) < v)
    lm_rows = lm_head_weight(model)[torch.arange(v)]
    ttt = TTTModel(head, model.get_input_embeddings().weight, lm_rows, o.ttt_steps, o.step_weight_decay,
                   o.loss_chunk_tokens)
    opt = torch.optim.AdamW([p for p in ttt.parameters() if p.requires_grad], lr=o.lr)
    h, g = model.config.hidden_size, torch.Generator().manual_seed(0)
    ids = torch.randint(0, v, (rows, length), generator=g)
    mask = torch.zeros(rows, length, dtype=torch.bool)
    mask[:, length - min(length, max(1, round(answer_tokens))):] = True
    aux, final = torch.randn(rows, length, 3 * h, generator=g), torch.randn(rows, length, h, generator=g)
    argmax = torch.randint(0, v, (rows, length), generator=g)
    online = r.features.mode == "online"
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=o.precision("cpu") == "bf16")
    seconds = 0.0
    for i in range(steps + 1):  # the first step warms up
        t0 = time.time()
        if online:  # the target's forward is part of every online step
            with torch.no_grad():
                model(ids, output_hidden_states=True)
        with autocast:  # as the trainer's accelerate autocast
            loss, _ = ttt(ids, mask, aux, final, argmax)
        loss.backward()
        opt.step()
        opt.zero_grad()
        seconds += (time.time() - t0) if i else 0.0
    return seconds / steps
