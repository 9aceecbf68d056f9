"""Statistics for the sampling tests."""

from __future__ import annotations

import torch


def chi2_pvalue(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's χ² test: survival function of χ²(k - 1) = the regularized upper incomplete gamma."""
    stat = ((observed - expected) ** 2 / expected).sum()
    df = observed.numel() - 1
    return torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2).item()
