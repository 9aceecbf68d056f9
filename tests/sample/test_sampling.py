"""Keyed sampling: exact distribution, filters keep the right ids, and draws depend only on (seed, position)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers.statistics import chi2_pvalue
from tsengine.cache.kv_cache import BlockManager
from tsengine.sample.sampling import RowParams, filtered_logprobs, sample, uniform
from tsengine.sampling_params import SamplingParams


def _rp(n, **kw):
    return RowParams.build([SamplingParams(**kw)] * n, list(range(n)), "cpu")


def test_gumbel_max_samples_the_softmax():
    """20,000 draws over 8 ids, one per (seed, position) key: χ² against softmax(logits / T), p > 0.001."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    n, t = 20000, 0.8
    rows = logits.expand(n, -1)
    rp = RowParams.build([SamplingParams(temperature=t)] * n, [7] * n, "cpu")
    draws = sample(rows, rp, torch.arange(n))
    observed = torch.bincount(draws, minlength=8).double()
    expected = torch.softmax(logits.double() / t, -1) * n
    assert chi2_pvalue(observed, expected) > 1e-3


def test_chi2_pvalue_rejects_a_wrong_distribution():
    expected = torch.full((8,), 2500.0, dtype=torch.float64)
    assert chi2_pvalue(expected.clone(), expected) > 0.99
    skewed = expected.clone()
    skewed[0] += 200
    skewed[1] -= 200
    assert chi2_pvalue(skewed, expected) < 1e-3


def test_noise_is_a_function_of_seed_and_position_only():
    seeds, pos = torch.tensor([3, 3, 9]), torch.tensor([10, 11, 10])
    u = uniform(seeds, pos, 1000)
    assert torch.equal(u[0], uniform(seeds[:1], pos[:1], 1000)[0])  # batch-independent
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert (u > 0).all() and (u < 1).all()
    assert abs(u.mean().item() - 0.5) < 0.02


def test_filters():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    keep = lambda **kw: torch.isfinite(filtered_logprobs(logits, _rp(1, **kw)))[0].tolist()  # noqa: E731
    assert keep(top_k=2) == [True, True, False, False, False]
    assert keep(top_p=0.7) == [True, True, False, False, False]  # 0.5 + 0.2 reaches 0.7
    assert keep(top_p=0.71) == [True, True, True, False, False]
    assert keep(min_p=0.3) == [True, True, False, False, False]  # >= 0.3 * 0.5
    assert keep(top_p=0.01) == [True, False, False, False, False]  # the top id always survives


def test_greedy_takes_the_lowest_index_on_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    assert sample(logits, _rp(1, temperature=0), torch.tensor([0])).item() == 1


@pytest.mark.parametrize("field, value", [("temperature", -0.1), ("temperature", math.nan), ("top_p", 0.0),
                                          ("top_p", 1.5), ("max_tokens", 0), ("n", 0), ("seed", 2**64),
                                          ("min_p", 2.0), ("top_k", -5)])
def test_bad_sampling_params_name_the_field(field, value):
    from tsengine.errors import UserError

    with pytest.raises(UserError, match=field):
        SamplingParams(**{field: value})


def test_block_manager_refcounts():
    bm = BlockManager(6, 4)
    a, b = [], []
    bm.grow(a, 9)  # 3 blocks
    assert len(a) == 3 and bm.num_free == 3
    shared = bm.share(a)
    bm.check([a, shared])
    bm.release(a)
    assert bm.num_free == 3  # still referenced by `shared`
    assert not bm.can_grow(b, 17) and bm.can_grow(b, 12)
    bm.grow(b, 12)
    bm.shrink(b, 5)
    assert len(b) == 2
    bm.check([shared, b])
    bm.release(shared)
    bm.release(b)
    bm.check([])
    assert bm.num_free == 6
    with pytest.raises(AssertionError):
        bm.check([[0]])


def test_uniforms_stay_inside_the_open_interval():
    """Every 32-bit hash maps strictly inside (0, 1) (the top of the range once rounded to 1.0, which made
    Gumbel noise +inf), and a large-vocab draw never picks a filtered id."""
    from tsengine.sample.sampling import unit

    top = unit(torch.arange(2**23, dtype=torch.long) << 9 | 0x1FF)  # every value the top 23 bits can take
    assert float(top.min()) > 0 and float(top.max()) < 1 and torch.isfinite(-torch.log(-torch.log(top))).all()
    v, n = 128256, 2000
    logits = torch.full((v,), -30.0)
    logits[:5] = torch.tensor([12.0, 2.0, 1.0, 0.5, 0.0])  # one id holds almost all the mass
    rp = RowParams.build([SamplingParams(temperature=1.0, top_k=5)] * n, list(range(n)), "cpu")
    draws = sample(logits.expand(n, -1), rp, torch.arange(n) + 7)
    assert int(draws.max()) < 5
