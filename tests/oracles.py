"""Test-only oracles: slow, obviously correct versions of what the fast code computes, used nowhere but
tests/. The training unroll and loss (`train/ttt.py`, `train/loss.py`) are checked in
tests/train/test_ttt.py against per-position loops; the paged attention backends in tests/model/test_triton_attention.py
against a dense float64 loop.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tsengine.eagle3.head import Eagle3Head


# ---- training (tests/train/test_ttt.py) -----------------------------------------------------------------------------
@torch.no_grad()
def naive_unroll(head: Eagle3Head, embed: torch.Tensor, hidden0: torch.Tensor, input_ids: torch.Tensor,
                 steps: int) -> list[torch.Tensor]:
    """The oracle of `tsengine.train.ttt.unroll`: for every base t, draft a chain with the head's dense
    causal forward, one step at a time, exactly as the reference generator does (prefix keys from step 0,
    then its own chain)."""
    b, t, _ = hidden0.shape
    outs = [torch.zeros_like(hidden0) for _ in range(steps)]
    for bi in range(b):
        ids = input_ids[bi]
        for base in range(t):
            tok = [int(ids[i + 1]) if i + 1 < t else 0 for i in range(base + 1)]
            hid = [hidden0[bi, i] for i in range(base + 1)]
            pos = list(range(base + 1))
            for k in range(steps):
                emb = F.embedding(torch.tensor([tok]), embed).to(hidden0.dtype)
                cos, sin = head.rope(torch.tensor([pos]), hidden0)
                out, _ = head.midlayer(emb, torch.stack(hid)[None], cos, sin)
                outs[k][bi, base] = out[0, -1]
                nxt = base + k + 2
                tok.append(int(ids[nxt]) if nxt < t else 0)
                hid.append(out[0, -1])
                pos.append(base + k + 1)
    return outs


def naive_step_loss(head, out, final, loss_mask, target_argmax, target_lm_rows, k):
    """The oracle of `tsengine.train.loss.step_loss` (with `teacher` and `valid_positions`): a plain loop
    over positions with the head's own `logits` (tests only)."""
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


# ---- attention (tests/model/test_triton_attention.py) ---------------------------------------------------------------
def dense_attention(q, k_cache, v_cache, ctx, scale):
    """The oracle of the paged attention backends (torch and Triton). Plain loop in float64: per token,
    gather its request's keys 0..position through the block table."""
    bs, nh, nkv = k_cache.shape[1], q.shape[1], k_cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    for t in range(ctx.num_tokens):
        b, p = int(ctx.seq_index[t]), int(ctx.positions[t])
        js = range(min(p + 1, int(ctx.context_lens[b])))
        slots = [(int(ctx.block_tables[b, j // bs]), j % bs) for j in js]
        k = torch.stack([k_cache[blk, off] for blk, off in slots]).double()  # [n, nkv, d]
        v = torch.stack([v_cache[blk, off] for blk, off in slots]).double()
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        w = torch.softmax(torch.einsum("hd,nhd->hn", q[t].double(), k) * scale, -1)
        out[t] = torch.einsum("hn,nhd->hd", w, v)
    return out
