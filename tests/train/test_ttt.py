"""Training-time test: the batched SDPA unroll equals the per-position chain loop, step 0 equals a plain
draft forward, and the chunked loss equals a naive per-position loss (values and gradients)."""

import pytest
import torch

from tests.helpers.heads import random_head
from tests.oracles import naive_step_loss, naive_unroll
from tsengine.train.loss import step_loss, teacher, valid_positions
from tsengine.train.ttt import ttt_mask, unroll


@pytest.fixture
def setup(tiny_models):
    model, _ = tiny_models["llama"]
    head = random_head(model, seed=3, draft_vocab_size=200, counts=torch.rand(model.config.vocab_size))
    torch.manual_seed(1)
    b, t = 2, 11
    ids = torch.randint(0, model.config.vocab_size, (b, t))
    aux = torch.randn(b, t, 3 * model.config.hidden_size)
    return model, head, ids, aux


def test_mask_is_causal_then_diagonals():
    m = ttt_mask(4, 2, "cpu")
    assert m.shape == (4, 12)
    assert torch.equal(m[:, :4], torch.ones(4, 4, dtype=torch.bool).tril())
    assert torch.equal(m[:, 4:8], torch.eye(4, dtype=torch.bool))
    assert torch.equal(m[:, 8:], torch.eye(4, dtype=torch.bool))


def test_unroll_equals_naive_chain_loop(setup):
    model, head, ids, aux = setup
    embed = model.get_input_embeddings().weight
    with torch.no_grad():
        h0 = head.project(aux)
        fast = unroll(head, embed, h0, ids, steps=4)
    slow = naive_unroll(head, embed, h0, ids, steps=4)
    for k, (a, b) in enumerate(zip(fast, slow)):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4, msg=f"step {k}")


def test_step0_is_a_plain_draft_forward(setup):
    model, head, ids, aux = setup
    with torch.no_grad():
        h0 = head.project(aux)
        first = unroll(head, model.get_input_embeddings().weight, h0, ids, steps=1)[0]
        t = ids.shape[1]
        # the head's own dense forward over (token t+1, features of t), causal, positions 0..T-2
        out, _, _ = head(ids[:, 1:], h0[:, :-1], torch.arange(t - 1).expand(ids.shape[0], -1))
    torch.testing.assert_close(first[:, :-1], out, atol=1e-5, rtol=1e-5)


def _loss_inputs(model, head, ids):
    torch.manual_seed(2)
    b, t = ids.shape
    out = torch.randn(b, t, head.config.hidden_size, requires_grad=True)
    final = torch.randn(b, t, model.config.hidden_size)
    w = model.get_output_embeddings().weight
    argmax = (final @ w.t()).argmax(-1)
    argmax[0, 3] = int((~head.t2d).nonzero()[0])  # one teacher argmax outside the draft vocab: excluded
    mask = torch.rand(b, t) > 0.3
    rows = w[torch.arange(head.config.draft_vocab_size) + head.d2t]
    return out, final, argmax, mask, rows


@pytest.mark.parametrize("k", [0, 2])
def test_chunked_loss_equals_naive(setup, k):
    model, head, ids, _ = setup
    out, final, argmax, mask, rows = _loss_inputs(model, head, ids)
    valid = valid_positions(mask, argmax, head.t2d, k)
    probs, where = teacher(final, rows, mask, argmax, head.t2d, chunk=5)
    got = step_loss(head, out, valid, probs, where, k, chunk=3)
    want, n, correct = naive_step_loss(head, out, final, mask, argmax, rows, k)
    assert int(got.valid) == n > 0 and int(got.correct) == correct
    torch.testing.assert_close(got.loss, want, atol=1e-5, rtol=1e-5)
    g_chunked = torch.autograd.grad(got.loss, out)[0]
    g_naive = torch.autograd.grad(want, out)[0]
    torch.testing.assert_close(g_chunked, g_naive, atol=1e-6, rtol=1e-4)
    w = head.lm_head.weight
    head.zero_grad()
    step_loss(head, out, valid, probs, where, k, chunk=3).loss.backward()
    g_fused_w = w.grad.clone()
    head.zero_grad()
    naive_step_loss(head, out, final, mask, argmax, rows, k)[0].backward()
    torch.testing.assert_close(g_fused_w, w.grad, atol=1e-6, rtol=1e-4)  # the fused gradient reaches lm_head


def test_invalid_positions_do_not_count(setup):
    model, head, ids, _ = setup
    out, final, argmax, mask, rows = _loss_inputs(model, head, ids)
    valid = valid_positions(mask, argmax, head.t2d, 0)
    assert not valid[0, 2]  # step 0 at base 2 is taught by position 3, whose argmax is outside the vocab
    assert torch.equal(valid[:, :-2], mask[:, 2:] & head.t2d[argmax[:, 1:-1]])
    assert not valid[:, -2:].any()  # nothing to predict past the end
    probs, where = teacher(final, rows, mask, argmax, head.t2d, chunk=4)
    none = step_loss(head, out, torch.zeros_like(valid), probs, where, 0, chunk=4)
    assert float(none.valid) == 0 and float(none.loss.detach()) == 0.0


def test_fc_scaling_tames_massive_channels_only():
    from tsengine.train.fc_init import sample_aux, scale_fc_columns

    torch.manual_seed(5)
    aux = torch.randn(300, 12)
    aux[:, 3] *= 40.0  # a "massive activation" channel
    seqs = [torch.cat([torch.full((1, 12), 1e4), aux[i * 100:(i + 1) * 100]]) for i in range(3)]
    sample = sample_aux(lambda i: seqs[i], [101] * 3, tokens=250)
    assert sample.shape == (250, 12) and sample.abs().max() < 1e3  # first tokens (sinks) are skipped
    w = torch.ones(4, 12)
    scale = scale_fc_columns(w, sample)
    assert scale[3] < 0.05 and torch.all(scale[[0, 1, 2, 4, 5]] > 0.5) and torch.all(scale <= 1)
    contrib = (sample * w[0]).abs().mean(0)
    assert contrib[3] < 2 * contrib.median()  # no channel starts louder than ~the median one


def test_aligned_steps_train_only_where_the_chain_reaches(setup):
    """GRIFFIN's token-alignable training: with `aligned`, step k counts base t only if steps 0..k-1 drafted
    the target's token there; validation (eval mode) scores every base as before. Oracle: a plain loop."""
    from tsengine.train.trainer import TTTModel

    model, head, ids, aux = setup
    b, t = ids.shape
    embed, w = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    draft_ids = torch.arange(head.config.draft_vocab_size) + head.d2t
    rows = w[draft_ids]
    with torch.no_grad():
        outs = unroll(head, embed, head.project(aux), ids, steps=3)
        drafted = [draft_ids[head.logits(o).argmax(-1)] for o in outs]  # [B, T] target ids per step
    # the target agrees with step 0 at about half the bases, so later steps have bases to keep and to drop
    torch.manual_seed(4)
    final = torch.randn(b, t, model.config.hidden_size)
    agree = torch.rand(b, t) < 0.5
    for bi in range(b):
        for i in range(t - 1):
            if agree[bi, i]:
                final[bi, i + 1] = 50 * w[drafted[0][bi, i]]
    argmax = (final @ w.t()).argmax(-1)
    mask = torch.ones(b, t, dtype=torch.bool)
    teacher_ids = draft_ids[(final @ rows.t()).argmax(-1)]

    expected, reached = [], torch.ones(b, t, dtype=torch.bool)
    for k in range(3):
        n = 0
        hit = torch.zeros(b, t, dtype=torch.bool)
        for bi in range(b):
            for i in range(t):
                j = i + k + 2
                if j >= t or not mask[bi, j] or not head.t2d[argmax[bi, j - 1]]:
                    continue
                hit[bi, i] = bool(drafted[k][bi, i] == teacher_ids[bi, j - 1])
                n += int(reached[bi, i])
        expected.append(n)
        reached &= hit

    def counts(aligned: bool, training: bool) -> list[int]:
        m = TTTModel(head, embed, rows, steps=3, decay=0.8, chunk=4, aligned=aligned).train(training)
        with torch.no_grad():
            _, stats = m(ids, mask, aux, final, argmax)
        return [int(n) for n in stats[:, 1]]

    plain = counts(False, True)
    assert counts(True, True) == expected
    assert 0 < expected[1] < plain[1]  # step 1 dropped some bases and kept some: the check has teeth
    assert counts(True, False) == plain  # validation scores every base
