"""The training pipeline end to end on a tiny target: stages, loss falls, export is lossless, offline ==
online features, exact resume after kill -9, a real 2-process (gloo) run."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.data import write_rows
from tests.helpers.reference import assert_lossless
from tsengine.eagle3.format import load_head
from tsengine.infer.reference import ReferenceSpeculator, SpecShape, greedy_generate
from tsengine.targets import encode_prompt, eos_ids

REPO = Path(__file__).resolve().parents[2]
RATES = {"regen_s_per_answer": 1.0, "tokens_per_answer": 20.0, "train_s_per_answer": 0.2, "eval_s": 30.0,
         "probe_s": 1.0}


def recipe(tmp: Path, target: Path, **over) -> Path:
    base = {
        "target": str(target), "output_dir": str(tmp / "run"), "seed": 0,
        "data": {"source": str(write_rows(tmp / "rows.jsonl", 48, 0, with_answers=False)),
                 "val_source": str(write_rows(tmp / "val.jsonl", 6, 1, with_answers=False)), "max_length": 128},
        "regen": {"batch_size": 8, "max_new_tokens": 20},
        "vocab": {"draft_vocab_size": 160},
        "features": {"mode": "online"},
        "train": {"ttt_steps": 3, "lr": 3e-3, "epochs": 4, "batch_tokens": 384, "checkpoint_every": 5,
                  "eval_every": 10, "log_every": 1},
        "log": {"report_to": "none"},
        "eval": {"num_prompts": 2, "max_new_tokens": 12, "chain": [3, 1, 4], "tree": [3, 4, 8]},
    }
    for k, v in over.items():
        base[k] = {**base[k], **v} if isinstance(v, dict) else v
    path = tmp / "recipe.yaml"
    path.write_text(json.dumps(base))  # JSON is YAML
    return path


def launch(*args, nproc: int = 1, wait: bool = True):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
               str(29500 + os.getpid() % 1000), str(REPO / "train/train_eagle3.py"), *args]
    else:
        cmd = [sys.executable, str(REPO / "train/train_eagle3.py"), *args]
    if not wait:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def metrics(run: Path, split: str = "train") -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["split"] == split]


def test_tiny_end_to_end(tiny_dirs, tiny_models, tmp_path):
    launch("--recipe", str(recipe(tmp_path, tiny_dirs["llama"])))
    run = tmp_path / "run"
    rows = metrics(run)
    losses = [r["loss"] for r in rows]
    assert len(rows) > 20 and {f"acc_{k}" for k in range(3)} <= set(rows[0])
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.1, (first, last)  # the head learns the target
    assert (run / "acc_k.png").stat().st_size > 0 and metrics(run, "val")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["eval"]["3,1,4"]["tau"] >= 1.0 and "3,4,8" in summary["eval"]
    assert summary["data"]["train"]["rows"] == 48 and summary["vocab"]["draft_vocab_size"] == 160
    # the exported head is a valid head for the target, and speculation with it is lossless
    model, tok = tiny_models["llama"]
    head = load_head(run / "export", target=model.config, embeddings=model.get_input_embeddings().weight)
    for text in ("the water", "how long two people"):
        prompt = encode_prompt(tok, text)
        greedy = greedy_generate(model, prompt, 20, eos_ids(model, tok))
        for shape in (SpecShape(3, 1, 4), SpecShape(3, 4, 8)):
            out = ReferenceSpeculator(model, head, shape).generate(prompt, 20, eos_ids(model, tok))
            assert_lossless(model, prompt, out.tokens, greedy)
    # a second launch finds every stage done and the run finished: nothing is redone
    r = launch("--recipe", str(recipe(tmp_path, tiny_dirs["llama"])))
    assert "regenerate:" not in r.stdout and len(metrics(run)) == len(rows)


def test_a_budget_sizes_the_run_from_this_machines_speeds(tiny_dirs, tmp_path):
    """budget_minutes: the run measures this machine, plans prompts, answers and epochs (kept in plan.json),
    regenerates and trains the planned size and reports plan beside actual; a relaunch keeps the plan and
    redoes nothing."""
    path = recipe(tmp_path, tiny_dirs["llama"], budget_minutes=30, train={"epochs": 1})
    r = launch("--recipe", str(path))
    run = tmp_path / "run"
    saved = json.loads((run / "plan.json").read_text())
    assert saved["rates"]["regen_s_per_answer"] > 0 and saved["rates"]["train_s_per_answer"] > 0
    plan = saved["plan"]
    # every prompt fits: the time left buys sampled answers (up to 4 a prompt), then epochs (up to 4x the recipe's)
    assert plan["rows"] == 48 and plan["answers"] == 4 and plan["epochs"] == 4
    assert "plan: budget 30.0 min: 48 training prompts x 4 answers x 4 epochs" in r.stdout
    summary = json.loads((run / "summary.json").read_text())
    assert summary["data"]["train"]["rows"] == 48 * 4 and summary["recipe"]["train"]["epochs"] == 4
    g = summary["recipe"]["regen"]  # the greedy answer and 3 sampled at T 0.7, each its own row
    assert (g["temperature"], g["include_greedy"], g["samples_per_prompt"]) == (0.7, True, 3)
    used = [json.loads(x)["id"] for x in (run / "data" / "used" / "train.jsonl").read_text().splitlines()]
    assert len(used) == 48 * 4 and sum("~s" not in i for i in used) == 48
    assert summary["train"]["stopped_by"] == "steps" and summary["budget"]["within_budget"]
    assert {"data", "regenerate", "train"} <= set(summary["stage_s"])
    assert not (run / "budget-probe").exists()
    again = launch("--recipe", str(path))
    assert "regenerate:" not in again.stdout and json.loads((run / "plan.json").read_text()) == saved


def test_a_budgeted_run_stops_training_at_its_deadline_and_keeps_the_head(tiny_dirs, tmp_path):
    """The plan's deadline ends training whatever the estimate said: the step that reaches it is validated,
    exported and checkpointed (a plan whose deadline has passed at the start, its epochs already fitted
    (a relaunch): one step)."""
    run = tmp_path / "run"
    run.mkdir()
    plan = {"budget_s": 600.0, "rows": 24, "answers": 1, "epochs": 4, "expected_s": {}, "train_deadline_s": 0.0,
            "tokens": 0.0}
    (run / "plan.json").write_text(json.dumps({"plan": plan, "rates": RATES, "fitted_epochs": 4}))
    launch("--recipe", str(recipe(tmp_path, tiny_dirs["llama"], budget_minutes=10)))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["data"]["train"]["rows"] == 24
    train = summary["train"]
    assert train["stopped_by"] == "budget" and train["steps"] == 1 < train["planned_steps"]
    assert (run / "export" / "model.safetensors").exists() and metrics(run, "val")[-1]["step"] == 1
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-00000001"]


def test_a_fractional_epoch_ends_within_the_last_pass(tiny_dirs, tmp_path):
    """train.epochs 1.5 (what a budget plans with time left over): the first pass whole, then half of the
    second, with the cosine schedule ending at that step."""
    launch("--recipe", str(recipe(tmp_path, tiny_dirs["llama"], train={"epochs": 1.5, "eval_every": 1000},
                                  eval={"num_prompts": 1, "tree": None})))
    rows = metrics(tmp_path / "run")
    per_epoch = sum(r["epoch"] == 0 for r in rows)
    assert per_epoch > 2 and len(rows) == round(1.5 * per_epoch) and rows[-1]["epoch"] == 1
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["train"]["planned_steps"] == len(rows) and rows[-1]["lr"] < 1e-6 < rows[len(rows) // 2]["lr"]


def test_training_is_refitted_to_the_time_left_when_it_starts(tiny_dirs, tmp_path):
    """Data stages that overran their estimate shorten training by its schedule (fewer epochs), decided once
    and kept in plan.json; here the deadline has passed at the start, so a tenth of an epoch is what fits."""
    run = tmp_path / "run"
    run.mkdir()
    plan = {"budget_s": 600.0, "rows": 24, "answers": 1, "epochs": 4, "expected_s": {}, "train_deadline_s": 0.0,
            "tokens": 0.0}
    (run / "plan.json").write_text(json.dumps({"plan": plan, "rates": RATES}))
    r = launch("--recipe", str(recipe(tmp_path, tiny_dirs["llama"], budget_minutes=10)))
    assert "budget: 0.1 epochs fit before the deadline (planned 4)" in r.stdout
    saved = json.loads((run / "plan.json").read_text())
    assert saved["fitted_epochs"] == 0.1 and saved["plan"] == plan
    summary = json.loads((run / "summary.json").read_text())
    assert summary["budget"]["plan"]["fitted_epochs"] == 0.1
    # the schedule is the refitted one: a tenth of an epoch of 48 rows' micro-batches (the annealing at a
    # fractional end: test_a_fractional_epoch_ends_within_the_last_pass)
    assert summary["train"]["planned_steps"] == len(metrics(run)) < 4


def test_offline_features_train_like_online(tiny_dirs, tmp_path):
    losses = {}
    for mode in ("online", "offline"):
        d = tmp_path / mode
        d.mkdir()
        launch("--recipe", str(recipe(d, tiny_dirs["qwen3"], data={"regenerate": False, "source": str(
            write_rows(d / "chat.jsonl", 40, 5, with_answers=True)), "val_source": str(
            write_rows(d / "chatval.jsonl", 4, 6, with_answers=True))}, features={"mode": mode},
            # fp32 both ways: the claim is equality up to GEMM blocking, which bf16 autocast would round away
            train={"epochs": 1, "max_steps": 8, "eval_every": 100, "mixed_precision": "no"},
            eval={"num_prompts": 1, "tree": None})))
        losses[mode] = [(r["loss"], r["acc_0"]) for r in metrics(d / "run")]
    index = json.loads((tmp_path / "offline/run/features/train/index.json").read_text())
    assert index["bytes_per_token"] == pytest.approx((3 * 64 + 64) * 4 + 4, rel=0.05)  # fp32 aux+final, int32 argmax
    assert len(losses["online"]) == 8
    # same features up to fp32 GEMM blocking (the dump batches differently): the runs agree closely
    for (a, x), (b, y) in zip(losses["online"], losses["offline"]):
        assert a == pytest.approx(b, rel=1e-5) and x == y


def test_bf16_regeneration_and_training_make_a_head_for_the_fp32_target(tiny_dirs, tiny_models, tmp_path):
    """What `auto` picks on a CPU with bf16 units (forced here, so every CPU runs it; emulated where there are
    none): answers and features from the target in bf16, training under bf16 autocast. The head still learns,
    is exported in fp32, and speculation with it against the fp32 target is lossless."""
    launch("--recipe", str(recipe(tmp_path, tiny_dirs["llama"], regen={"dtype": "bfloat16"},
                                  features={"mode": "offline"}, train={"mixed_precision": "bf16"})))
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["precision"] == {"regen": "bfloat16", "train": "bf16"}
    losses = [r["loss"] for r in metrics(run)]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.1
    model, tok = tiny_models["llama"]
    head = load_head(run / "export", target=model.config, embeddings=model.get_input_embeddings().weight)
    assert {p.dtype for p in head.parameters()} == {torch.float32}
    prompt = encode_prompt(tok, "the water")
    greedy = greedy_generate(model, prompt, 20, eos_ids(model, tok))
    out = ReferenceSpeculator(model, head, SpecShape(3, 1, 4)).generate(prompt, 20, eos_ids(model, tok))
    assert_lossless(model, prompt, out.tokens, greedy)


def test_resume_after_kill_matches_uninterrupted(tiny_dirs, tmp_path):
    over = {"train": {"epochs": 20, "max_steps": 40, "checkpoint_every": 5, "eval_every": 1000}, "eval": {
        "num_prompts": 1, "tree": None}}
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    launch("--recipe", str(recipe(tmp_path / "a", tiny_dirs["llama"], **over)))
    rb = recipe(tmp_path / "b", tiny_dirs["llama"], **over)
    proc = launch("--recipe", str(rb), wait=False)
    ckpts = tmp_path / "b/run/checkpoints"
    deadline = time.time() + 600
    while not any((c / "COMPLETE").exists() for c in ckpts.glob("step-*")) and time.time() < deadline:
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = max(json.loads(line)["step"] for line in (tmp_path / "b/run/metrics.jsonl").read_text().splitlines())
    assert killed_at < 40, "the run finished before it could be killed"
    launch("--recipe", str(rb))
    a, b = metrics(tmp_path / "a/run"), metrics(tmp_path / "b/run")
    assert [r["step"] for r in b] == list(range(1, 41))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]  # bit-exact, not approximately
    assert [r["lr"] for r in a] == [r["lr"] for r in b]
    ha = load_head(tmp_path / "a/run/export")
    hb = load_head(tmp_path / "b/run/export")
    assert all(torch.equal(x, y) for x, y in zip(ha.state_dict().values(), hb.state_dict().values()))


def test_two_process_cpu_run(tiny_dirs, tmp_path):
    d1, d2 = tmp_path / "one", tmp_path / "two"
    d1.mkdir(), d2.mkdir()
    over = {"train": {"epochs": 2, "eval_every": 1000}, "eval": {"num_prompts": 1, "tree": None}}
    launch("--recipe", str(recipe(d1, tiny_dirs["llama"], **over)))
    launch("--recipe", str(recipe(d2, tiny_dirs["llama"], **over)), nproc=2)
    one, two = metrics(d1 / "run"), metrics(d2 / "run")
    # each rank sees half of every epoch: half the optimizer steps, each over twice the tokens
    assert len(two) == len(one) // 2 or len(two) == (len(one) - 1) // 2
    assert two[-1]["tokens"] == pytest.approx(one[-1]["tokens"], rel=0.25)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in two)
    load_head(d2 / "run/export")
