"""The TTT loss: soft cross-entropy against the target, restricted to the draft vocab, chunked.

Step k at base t predicts token t+2+k; its teacher is the target's distribution at position t+1+k,
computed from the target's final hidden state through the target's frozen lm_head rows of the draft
vocab (so an 8B target's 128k-wide logits are never formed in the loss). A position counts only if the
predicted token is a trained (assistant) token and the target's argmax over the *full* vocab is in the
draft vocab (otherwise the draft cannot be right and the restricted softmax would teach it a wrong
favourite). Each step is normalised by its own valid count and weighted by decay**k.

Cost and memory: the teacher softmax is formed once per position (not once per step), only valid rows
are scored, and the draft logits are formed one chunk at a time with their gradient in the same pass
(`_FusedSoftCE`), so [tokens, vocab] fp32 exists for one chunk of one step at a time; the only
batch-wide vocab-sized tensor is the teacher [taught positions, draft vocab], shared by all steps.

The test oracle, `naive_step_loss` (a plain loop over positions), is in tests/oracles.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tsengine.train.ttt import shift


@dataclass
class StepStats:
    loss: torch.Tensor  # differentiable mean CE over valid positions (0 if none)
    valid: torch.Tensor  # count, float
    correct: torch.Tensor  # draft argmax == target argmax, count
    hits: torch.Tensor  # [B*T] bool: the draft's argmax was the target's at this base (False where not scored)


class _FusedSoftCE(torch.autograd.Function):
    """Σ soft-CE(x @ wᵀ, p) over rows, chunked, with the gradient formed in the same pass.

    d CE / d logits = softmax(logits) - p (p sums to 1), so each chunk's logits are made once and
    dropped: nothing [rows, vocab]-sized is kept for backward and nothing is recomputed (activation
    checkpointing would form the logits twice). Also returns each row's argmax, for acc_k."""

    @staticmethod
    def forward(ctx, x, w, p, chunk: int):
        xf, wf = x.float(), w.float()
        gx = torch.empty_like(xf)
        gw = torch.zeros_like(wf)
        total = torch.zeros((), device=x.device)
        arg = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
        for s in range(0, x.shape[0], chunk):
            z = xf[s:s + chunk] @ wf.t()
            logq = torch.log_softmax(z, dim=-1)
            total -= (p[s:s + chunk] * logq).sum()
            g = logq.exp_() - p[s:s + chunk]
            gx[s:s + chunk] = g @ wf
            gw += g.t() @ xf[s:s + chunk]
            arg[s:s + chunk] = z.argmax(-1)
        ctx.save_for_backward(gx.to(x.dtype), gw.to(w.dtype))
        ctx.mark_non_differentiable(arg)
        return total, arg

    @staticmethod
    def backward(ctx, grad_total, _grad_arg):
        gx, gw = ctx.saved_tensors
        return gx * grad_total, gw * grad_total, None, None


def teacher(final: torch.Tensor, target_lm_rows: torch.Tensor, loss_mask: torch.Tensor, target_argmax: torch.Tensor,
            t2d: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's softmax over the draft vocab at every position that teaches some step, computed once
    per batch (steps share teachers: step k at base t and step k-1 at base t+1 learn the same token).
    Returns (probs [n, draft_vocab] fp32, row of each flat position in probs, -1 where not needed)."""
    need = (shift(loss_mask, 1, False) & t2d[target_argmax]).flatten()
    idx = need.nonzero().squeeze(1)
    where = torch.full(need.shape, -1, dtype=torch.long, device=final.device)
    where[idx] = torch.arange(idx.numel(), device=final.device)
    x = final.flatten(0, 1).index_select(0, idx).float()
    w = target_lm_rows.float()
    with torch.no_grad(), torch.autocast(final.device.type, enabled=False):
        parts = [torch.softmax(x[s:s + chunk] @ w.t(), dim=-1) for s in range(0, idx.numel(), chunk)]
    return (torch.cat(parts) if parts else x.new_zeros(0, w.shape[0])), where


def valid_positions(loss_mask: torch.Tensor, target_argmax: torch.Tensor, t2d: torch.Tensor, k: int) -> torch.Tensor:
    """[B, T] bool: step k at base t is scored (token t+2+k trained on, argmax at t+1+k drafted)."""
    trained = shift(loss_mask, k + 2, False)
    in_vocab = t2d[shift(target_argmax, k + 1, 0)]
    return trained & in_vocab


def step_loss(head, out: torch.Tensor, valid: torch.Tensor, probs: torch.Tensor, where: torch.Tensor, k: int,
              chunk: int) -> StepStats:
    """`out` [B, T, H] head output of step k; `valid` [B, T] from `valid_positions`; (`probs`, `where`)
    from `teacher`. Step k at base t is taught by position t+1+k."""
    idx = valid.flatten().nonzero().squeeze(1)
    n = idx.numel()
    if n == 0:  # keep the graph connected: DDP expects a gradient for every parameter
        zero = head.logits(out[:, :1]).sum() * 0.0
        return StepStats(zero, torch.zeros((), device=out.device), torch.zeros((), device=out.device), valid.flatten())
    rows = head.norm(out.flatten(0, 1).index_select(0, idx))
    p = probs.index_select(0, where[idx + k + 1])
    with torch.autocast(out.device.type, enabled=False):  # the loss is fp32 even under bf16 autocast
        ce_sum, arg = _FusedSoftCE.apply(rows, head.lm_head.weight, p, chunk)
    hit = arg == p.argmax(-1)  # same draft id <=> same target id (d2t is injective)
    hits = torch.zeros(valid.numel(), dtype=torch.bool, device=out.device).index_put_((idx,), hit)
    return StepStats(ce_sum / n, torch.tensor(float(n), device=out.device), hit.sum().float(), hits)
