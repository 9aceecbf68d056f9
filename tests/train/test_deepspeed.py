"""DeepSpeed ZeRO-2 for real on CPU (gloo): 2 processes through `accelerate launch`, against the DDP run of
the same recipe, and resumed from a DeepSpeed checkpoint. The GPU configs differ only in precision and
bucket overlap; what runs here is the same engine, sharding, clipping and checkpoint path.

The first DeepSpeed launch on a machine JIT-builds DeepSpeed's CPU shared-memory comm op (~3 min on two
cores, cached in ~/.cache/torch_extensions), hence `slow`."""

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tsengine.errors import UserError
from tsengine.train.trainer import _deepspeed_clipping

REPO = Path(__file__).resolve().parents[2]
WORDS = "the water one number how long two people call first who may down side been now find".split()
DDP, ZERO2 = "recipes/accelerate/cpu_2proc.yaml", "recipes/accelerate/deepspeed_zero2_cpu.yaml"


def _chat_rows(path: Path, n: int, seed: int) -> Path:
    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(n):
            user = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 10)))
            answer = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 20)))
            f.write(json.dumps({"id": f"r{seed}-{i}", "messages": [{"role": "user", "content": user},
                                                                  {"role": "assistant", "content": answer}]}) + "\n")
    return path


def _recipe(tmp: Path, target: Path) -> Path:
    # grad_accum 2 and a clip below the measured grad norms (0.52-0.64): accumulation and clipping both act,
    # so a DeepSpeed that scaled or clipped differently from DDP would change the losses.
    r = {"target": str(target), "output_dir": str(tmp / "run"), "seed": 0,
         "data": {"source": str(_chat_rows(tmp / "rows.jsonl", 48, 0)), "regenerate": False,
                  "val_source": str(_chat_rows(tmp / "val.jsonl", 6, 1)), "max_length": 128},
         "vocab": {"draft_vocab_size": 160}, "features": {"mode": "online"},
         "train": {"ttt_steps": 3, "lr": 3e-3, "epochs": 4, "batch_tokens": 384, "grad_accum": 2, "grad_clip": 0.5,
                   "checkpoint_every": 5, "keep_checkpoints": 2, "eval_every": 1000, "log_every": 1,
                   "mixed_precision": "no"},  # fp32 on every CPU: the claim is equal fp32 math (bf16 ZeRO differs)
         "log": {"report_to": "none"},
         "eval": {"num_prompts": 1, "max_new_tokens": 8, "chain": [3, 1, 4], "tree": None}}
    path = tmp / "recipe.yaml"
    path.write_text(json.dumps(r))  # JSON is YAML
    return path


def _launch(config: str, recipe: Path, port: int) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "TSENGINE_NUM_THREADS")}
    env.update(TOKENIZERS_PARALLELISM="false", HF_HOME=str(recipe.parent / "hf"))  # no user accelerate config
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config, "--main_process_port",
           str(port), "train/train_eagle3.py", "--recipe", str(recipe)]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-4000:]


def _train_rows(run: Path) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["split"] == "train"]


@pytest.mark.slow
def test_zero2_on_cpu_matches_ddp_and_resumes(tiny_dirs, tmp_path):
    port = 29500 + os.getpid() % 500
    runs = {}
    for name, config in (("ddp", DDP), ("zero2", ZERO2)):
        (tmp_path / name).mkdir()
        _launch(config, _recipe(tmp_path / name, tiny_dirs["llama"]), port + len(runs))
        runs[name] = tmp_path / name / "run"
    ddp, zero = _train_rows(runs["ddp"]), _train_rows(runs["zero2"])
    last = runs["zero2"] / "checkpoints" / f"step-{len(zero):08d}"
    # DeepSpeed really ran (accelerate silently falls back to DDP under Accelerator(cpu=True)): ZeRO wrote
    # one optimizer shard per rank; DDP writes one optimizer.bin
    assert sorted(p.name for p in (last / "pytorch_model").glob("zero_pp_rank_*_optim_states.pt")) == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert len(ddp) == len(zero) == 8
    # Same fp32 math; only the gradient reduction order differs (DDP all-reduce buckets vs ZeRO
    # reduce-scatter): measured |Δloss|/loss 0 on every step, |Δgrad_norm| ≤ 2e-7 relative.
    for a, b in zip(ddp, zero):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5) and b["lr"] == a["lr"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5) and b["tokens"] == a["tokens"]

    # Stop after step 5: drop the later checkpoint (as if the run had ended there), launch again. It must
    # load ZeRO's sharded optimizer, the scheduler and every rank's RNG, and retrace steps 6-8.
    head = (last / "head.safetensors").read_bytes()
    shutil.rmtree(last)
    assert (runs["zero2"] / "checkpoints/step-00000005/pytorch_model").is_dir()
    _launch(ZERO2, tmp_path / "zero2" / "recipe.yaml", port + 2)
    again = _train_rows(runs["zero2"])
    assert [r["step"] for r in again] == list(range(1, 9))
    for a, b in zip(zero, again):  # measured bit-identical; the tolerance only admits reduction-order noise
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6) and b["lr"] == a["lr"]
    assert (last / "head.safetensors").read_bytes() == head  # the resumed run ends on the same weights


def test_clipping_comes_from_the_recipe():
    cfg = {"gradient_clipping": "auto"}
    _deepspeed_clipping(cfg, 0.5)
    assert cfg["gradient_clipping"] == 0.5  # accelerate would fill "auto" with 1.0
    cfg = {}
    _deepspeed_clipping(cfg, 0.25)
    assert cfg["gradient_clipping"] == 0.25
    cfg = {"gradient_clipping": 0.5}
    _deepspeed_clipping(cfg, 0.5)
    assert cfg["gradient_clipping"] == 0.5
    with pytest.raises(UserError, match=r"gradient_clipping=1.0 differs from train.grad_clip=0.5.*auto"):
        _deepspeed_clipping({"gradient_clipping": 1.0}, 0.5)


@pytest.mark.parametrize("config", ["deepspeed_zero2.yaml", "deepspeed_zero2_cpu.yaml"])
def test_deepspeed_launch_configs_are_consistent(config):
    acc = yaml.safe_load((REPO / "recipes/accelerate" / config).read_text())
    ds_file = REPO / acc["deepspeed_config"]["deepspeed_config_file"]
    ds = json.loads(ds_file.read_text())
    # accelerate refuses mixed_precision next to a deepspeed_config_file; the recipe owns the clip value
    assert "mixed_precision" not in acc and ds["gradient_clipping"] == "auto"
    assert ds["zero_optimization"]["stage"] == 2 and ds["gradient_accumulation_steps"] == "auto"
