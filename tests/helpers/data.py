"""Training data rows written to disk."""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = "the water one number how long two people call first who may down side been now find".split()


def write_rows(path: Path, n: int, seed: int, with_answers: bool) -> Path:

    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(n):
            msgs = [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 10)))}]
            if with_answers:
                msgs.append({"role": "assistant",
                             "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 20)))})
            f.write(json.dumps({"id": f"r{seed}-{i}", "messages": msgs}) + "\n")
    return path
