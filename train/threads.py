"""Intra-op threads per process: the machine's cores split over the processes on it, unless the user chose.

Why this exists: `accelerate launch` without a config (the README's training command) exports
OMP_NUM_THREADS=1, and so does `torchrun --nproc_per_node N>1` and `accelerate launch` with a config whose
cores-per-process count (psutil's *physical* cores / processes) is not above 1. On a CPU machine that runs
training on one core: measured 2.2 s per step against 1.2 s under plain `python` on two cores.

The rule (first match wins):

1. `TSENGINE_NUM_THREADS=N` is the user's explicit choice, always; it is the only way to pin one thread per
   process under a launcher.
2. Under a launcher (`accelerate launch`, `torchrun`), OMP_NUM_THREADS=1 is the launcher's default and is
   replaced; a launcher cannot tell us whether a user typed that 1, so rule 1 is how to insist on it.
3. Any other OMP_NUM_THREADS is kept (the user's, or a launcher's considered value above 1).
4. Otherwise: cores available to this process (its CPU affinity) // processes on this machine, at least 1.
"""

from __future__ import annotations

import os
import sys

OURS = "TSENGINE_NUM_THREADS"
# Set in every process `accelerate launch` starts (ACCELERATE_DYNAMO_BACKEND) or torchrun starts (the rest).
_LAUNCHER_MARKS = ("ACCELERATE_DYNAMO_BACKEND", "TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE")
_LOCAL_SIZE = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")


def _positive(name: str, value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        from tsengine.errors import UserError

        raise UserError(f"{name}={value!r}: expected a positive integer (threads per process)")
    return n


def choose(env: dict[str, str], cores: int) -> tuple[int | None, str]:
    """(threads, why) under the rule above; None means keep what the environment already set."""
    if env.get(OURS, "").strip():
        return _positive(OURS, env[OURS].strip()), OURS
    launched = any(k in env for k in _LAUNCHER_MARKS)
    omp = env.get("OMP_NUM_THREADS", "").strip()
    if omp and not (launched and omp == "1"):
        return None, "OMP_NUM_THREADS"
    local = next((_positive(k, env[k]) for k in _LOCAL_SIZE if env.get(k, "").strip()), 1)
    return max(1, cores // local), f"{cores} cores / {local} local process(es)"


def use_machine_cores() -> int:
    """Apply the rule to this process; returns the thread count torch will use. Call it first in a main():
    the env var is set before torch loads (so OpenMP and any BLAS loaded later read it), and
    torch.set_num_threads resizes the pool if torch was already imported."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    from tsengine.errors import UserError

    try:
        n, _ = choose(dict(os.environ), cores)
    except UserError as e:  # raised before the command's own error handling: same message, same exit code
        print(f"{os.path.basename(sys.argv[0])}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if n is not None:
        os.environ["OMP_NUM_THREADS"] = str(n)
    import torch

    if n is not None:
        torch.set_num_threads(n)
    return torch.get_num_threads()
