"""Data-aware init of the head's fc: keep a few huge target channels from drowning the rest.

Decoder hidden states carry "massive activations": in SmolLM2-135M, channels 17, 247 and 507 sit 10-40x
above the median channel at every position (and ~25,000 on the first token). A random fc maps them to
one near-constant direction, so after the hidden norm every position looks alike and the head learns
slowly from scratch. Scaling fc's input columns so no channel starts louder than the median channel
fixes the start without touching the architecture (SGLang and vLLM still compute fc(cat(aux)) as is).
"""

from __future__ import annotations

import torch


@torch.no_grad()
def scale_fc_columns(fc_weight: torch.Tensor, aux_sample: torch.Tensor) -> torch.Tensor:
    """Per input channel scale min(1, median_rms / rms_c) applied to fc's columns; returns the scales.
    `aux_sample` [N, 3·H_target]: target features of ordinary positions (not the first token)."""
    rms = aux_sample.float().pow(2).mean(0).sqrt()
    typical = rms.median()
    scale = (typical / rms.clamp(min=typical)).to(fc_weight.dtype)
    fc_weight.mul_(scale.to(fc_weight.device)[None, :])
    return scale


def sample_aux(get_aux, lengths: list[int], tokens: int = 4096) -> torch.Tensor:
    """Features of up to `tokens` positions from the first examples, skipping each first token
    (the attention-sink position, orders of magnitude louder than the rest)."""
    parts, n, i = [], 0, 0
    while n < tokens and i < len(lengths):
        a = get_aux(i)[1:]
        parts.append(a)
        n, i = n + a.shape[0], i + 1
    return torch.cat(parts)[:tokens]
