"""The TTT loss: soft cross-entropy against the target, restricted to the draft vocab, chunked.

Step k at base t predicts token t+2+k; its teacher is the target's distribution at position t+1+k,
computed from the target's final hidden state through the target's frozen lm_head rows of the draft
vocab (so an 8B target's 128k-wide logits are never formed in the loss). A position counts only if the
predicted token is a trained (assistant) token and the target's argmax over the *full* vocab is in the
draft vocab (otherwise the draft cannot be right and the restricted softmax would teach it a wrong
favourite). Each step is normalised by its own valid count and weighted by decay**k.

Memory: only valid rows are gathered, and logits are formed one chunk at a time under activation
checkpointing, so [tokens, vocab] fp32 exists for one chunk of one step at a time, in forward and backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from train.ttt import shift


@dataclass
class StepStats:
    loss: torch.Tensor  # differentiable mean CE over valid positions (0 if none)
    valid: torch.Tensor  # count, float
    correct: torch.Tensor  # draft argmax == target argmax, count


def _chunk(head, target_w, out, final, draft_target_ids):
    """(sum of soft CE, number of correct argmaxes) for one chunk of rows."""
    logq = torch.log_softmax(head.logits(out).float(), dim=-1)
    p = torch.softmax(final.float() @ target_w.float().t(), dim=-1)
    ce = -(p * logq).sum()
    correct = (draft_target_ids[logq.argmax(-1)] == draft_target_ids[p.argmax(-1)]).sum()
    return ce, correct.float()


def valid_positions(loss_mask: torch.Tensor, target_argmax: torch.Tensor, t2d: torch.Tensor, k: int) -> torch.Tensor:
    """[B, T] bool: step k at base t is scored (token t+2+k trained on, argmax at t+1+k drafted)."""
    trained = shift(loss_mask, k + 2, False)
    in_vocab = t2d[shift(target_argmax, k + 1, 0)]
    return trained & in_vocab


def step_loss(head, out: torch.Tensor, final: torch.Tensor, valid: torch.Tensor, target_lm_rows: torch.Tensor,
              k: int, chunk: int) -> StepStats:
    """`out` [B, T, H] head output of step k; `final` [B, T, H_t] target final hidden (unshifted);
    `target_lm_rows` [draft_vocab, H_t]: the target lm_head rows of the draft ids."""
    idx = valid.flatten().nonzero().squeeze(1)
    n = idx.numel()
    zero = out.sum() * 0.0  # keeps the graph connected when nothing is valid (DDP needs every grad)
    if n == 0:
        return StepStats(zero, torch.zeros((), device=out.device), torch.zeros((), device=out.device))
    rows = out.flatten(0, 1).index_select(0, idx)
    teacher = shift(final, k + 1, 0.0).flatten(0, 1).index_select(0, idx)
    draft_target_ids = torch.arange(head.config.draft_vocab_size, device=out.device) + head.d2t
    ce_sum, correct = zero, torch.zeros((), device=out.device)
    for s in range(0, n, chunk):
        args = (head, target_lm_rows, rows[s:s + chunk], teacher[s:s + chunk], draft_target_ids)
        if torch.is_grad_enabled():
            c, ok = checkpoint(_chunk, *args, use_reentrant=False)
        else:
            c, ok = _chunk(*args)
        ce_sum, correct = ce_sum + c, correct + ok
    return StepStats(ce_sum / n, torch.tensor(float(n), device=out.device), correct)


def naive_step_loss(head, out, final, loss_mask, target_argmax, target_lm_rows, k):
    """The oracle: a plain loop over positions with the head's own `logits` (tests only)."""
    total, n, correct = 0.0, 0, 0
    b, t, _ = out.shape
    ids = torch.arange(head.config.draft_vocab_size) + head.d2t
    for bi in range(b):
        for i in range(t):
            j = i + k + 2
            if j >= t or not loss_mask[bi, j] or not head.t2d[target_argmax[bi, j - 1]]:
                continue
            logq = F.log_softmax(head.logits(out[bi, i]).float(), -1)
            p = F.softmax(final[bi, j - 1].float() @ target_lm_rows.float().t(), -1)
            total = total - (p * logq).sum()
            n += 1
            correct += int(ids[logq.argmax()] == ids[p.argmax()])
    return (total / n if n else torch.tensor(0.0)), n, correct
