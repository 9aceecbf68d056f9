"""Runs SpecForge's own CLI (`specforge train` / `specforge export`) on a CPU, in SpecForge's venv, for
bench/specforge_ab.py. Not part of tsengine: it imports only SpecForge and torch, never our package.

    SPECFORGE_VENV/bin/python bench/specforge_runner.py train -c CONFIG.yaml [overrides ...]
    SPECFORGE_VENV/bin/python bench/specforge_runner.py export --to sglang --checkpoint ... [...]

Two run-time changes, nothing edited in the installed package:
- SPECFORGE_DEVICE=cpu and a one-process torchrun environment (RANK=0, WORLD_SIZE=1, ...), so the CLI runs
  the trainer in this process (its launch plan is "worker") with gloo, and the patch below applies;
- the EAGLE-3 KL loss, a Triton kernel with no CPU path (`LogSoftmaxLoss.apply` in
  specforge/algorithms/eagle3/model.py), is swapped for SpecForge's own reference of the same math
  (`specforge.core.loss._compute_loss`, run eagerly) when the logits are not on a GPU.
After a train run it prints one line `SPECFORGE_STATE {...}` with the final step, read by the bench.
"""

from __future__ import annotations

import json
import os
import socket
import sys


def one_process_env() -> None:
    os.environ.setdefault("SPECFORGE_DEVICE", "cpu")
    if "RANK" in os.environ:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})


def patch_cpu_loss() -> None:
    import specforge.algorithms.eagle3.model as eagle3_model
    from specforge.core import loss

    triton_loss = loss.LogSoftmaxLoss
    reference = getattr(loss._compute_loss, "_torchdynamo_orig_callable", loss._compute_loss)

    class CpuFallbackLoss:
        """`LogSoftmaxLoss` on a GPU, SpecForge's reference `_compute_loss` (autograd) elsewhere."""

        @staticmethod
        def apply(logits, target_p, position_mask):
            if logits.is_cuda:
                return triton_loss.apply(logits, target_p, position_mask)
            return reference(logits, target_p, position_mask)

    eagle3_model.LogSoftmaxLoss = CpuFallbackLoss


def final_state(output_dir: str) -> dict:
    from specforge.export.checkpoint_io import resolve_training_state

    state = resolve_training_state(output_dir)
    return {k: v for k, v in state.items() if isinstance(v, (int, float, str)) and not isinstance(v, bool)}


def main(argv: list[str]) -> int:
    one_process_env()
    patch_cpu_loss()
    from specforge.cli import main as specforge_main

    rc = specforge_main(argv)
    if argv and argv[0] == "train" and not rc:
        from specforge.config import load_config

        i = argv.index("-c") if "-c" in argv else argv.index("--config")
        cfg = load_config(argv[i + 1], [a for a in argv[i + 2:] if "=" in a])
        print("SPECFORGE_STATE " + json.dumps(final_state(cfg.output_dir)), flush=True)
    return rc or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
