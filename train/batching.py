"""Micro-batches of prepared examples: which examples go together, and the padded tensors they make.

The plan is a pure function of (lengths, seed, epoch, world): exact resume relies on a restarted run
drawing the same batches in the same order, and DDP on every rank taking the same number of steps.
"""

from __future__ import annotations

import random

import torch


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
        ids[i, :n], att[i, :n], mask[i, :n] = (torch.tensor(r["input_ids"]), 1,
                                               torch.tensor(r["loss_mask"], dtype=torch.bool))
    return ids.to(device), att.to(device), mask.to(device)
