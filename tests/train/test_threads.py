"""Threads per process under every launch form: the machine's cores split over local processes, unless the
user chose (train/threads.py). Regression: `accelerate launch` used to leave training on one core."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tsengine.errors import UserError
from tsengine.train.threads import choose

REPO = Path(__file__).resolve().parents[2]
CORES = len(os.sched_getaffinity(0))
PROBE = """
import os, sys
sys.path.insert(0, {repo!r})
from tsengine.train.threads import use_machine_cores
os.write(1, ("THREADS %s %d\\n" % (os.environ.get("RANK", "-"), use_machine_cores())).encode())
"""


def _launch(tmp_path: Path, *launch_args: str, **env) -> dict[str, int]:
    script = tmp_path / "probe.py"
    script.write_text(PROBE.format(repo=str(REPO)))
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "TSENGINE_NUM_THREADS")}
    # HF_HOME in tmp: a developer's ~/.cache/huggingface/accelerate/default_config.yaml must not leak in
    clean.update(HF_HOME=str(tmp_path / "hf"), **env)
    r = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", *launch_args, str(script)], cwd=REPO,
                       env=clean, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    # the ranks share one stdout, which the launcher leaves unbuffered: print's pieces (words, newline) are
    # separate writes that interleave between ranks, so each rank writes its line in one os.write, and the
    # lines are matched, not split
    return {rank: int(n) for rank, n in re.findall(r"THREADS (\S+) (\d+)", r.stdout)}


@pytest.mark.skipif(CORES < 2, reason="one core: one thread is both the bug and the fix")
def test_accelerate_launch_uses_all_cores(tmp_path):
    # the README's form: no accelerate config, so accelerate exports OMP_NUM_THREADS=1
    assert _launch(tmp_path) == {"-": CORES}


@pytest.mark.skipif(CORES < 2, reason="needs two cores to split")
def test_two_process_config_splits_cores_and_starts_two_ranks(tmp_path):
    got = _launch(tmp_path, "--config_file", str(REPO / "recipes/accelerate/cpu_2proc.yaml"))
    assert got == {"0": CORES // 2, "1": CORES // 2}  # also: the config really starts two processes


def test_rule():
    launched = {"ACCELERATE_DYNAMO_BACKEND": "NO", "OMP_NUM_THREADS": "1"}
    assert choose(launched, 8)[0] == 8  # accelerate's default 1 is replaced
    assert choose({**launched, "LOCAL_WORLD_SIZE": "2"}, 8)[0] == 4
    assert choose({"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "3", "OMP_NUM_THREADS": "1"}, 8)[0] == 2
    assert choose({**launched, "LOCAL_WORLD_SIZE": "4"}, 2)[0] == 1  # never 0
    assert choose({**launched, "TSENGINE_NUM_THREADS": "1"}, 8)[0] == 1  # ours always wins
    assert choose({"OMP_NUM_THREADS": "3", "TSENGINE_NUM_THREADS": "5"}, 8)[0] == 5
    assert choose({"OMP_NUM_THREADS": "1"}, 8)[0] is None  # no launcher: the user's 1 is kept
    assert choose({**launched, "OMP_NUM_THREADS": "3"}, 8)[0] is None  # a value above 1 is kept
    assert choose({}, 6)[0] == 6


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
def test_bad_value_is_named(value):
    with pytest.raises(UserError, match="TSENGINE_NUM_THREADS.*positive integer"):
        choose({"TSENGINE_NUM_THREADS": value}, 4)


def test_bad_value_exits_2_without_traceback(tmp_path):
    env = {**os.environ, "TSENGINE_NUM_THREADS": "many"}
    r = subprocess.run([sys.executable, str(REPO / "train/train_eagle3.py"), "--recipe", "x.yaml"], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "TSENGINE_NUM_THREADS='many'" in r.stderr and "Traceback" not in r.stderr
