"""A CPU with or without bf16 units, as torch's run-time probes report it."""

import torch


def pretend_cpu(monkeypatch, amx: bool | None, avx512_bf16: bool | None) -> None:
    """None: a torch without that probe."""
    for name, value in (("_is_amx_tile_supported", amx), ("_is_avx512_bf16_supported", avx512_bf16)):
        if value is None:
            monkeypatch.delattr(torch.cpu, name, raising=False)
        else:
            monkeypatch.setattr(torch.cpu, name, lambda v=value: v)
