"""A request for n samples becomes n engine requests of one sample each.

The engine schedules, preempts and verifies one sequence per request, so n samples are n requests that the
caller merges back by index. The offline API and the server both fan out here, so a seeded request gets
the same n samples from either: sample 0 keeps the request's seed (n=1 and choice 0 of n>1 agree) and each
further sample gets its own seed derived from it.
"""

from __future__ import annotations

import dataclasses

from tsengine.sampling_params import SamplingParams


def fan_out(request_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
    """(engine request id, its one-sample params) for each sample, in sample order."""
    return [(f"{request_id}-{i}", dataclasses.replace(params, n=1, seed=_sample_seed(params.seed, i)))
            for i in range(params.n)]


def _sample_seed(seed: int | None, index: int) -> int | None:
    return seed if seed is None or index == 0 else (seed * 1_000_003 + index) % 2**62
