"""Which devices compute in bf16 natively, found at run time.

The development machines differ from one session to the next (an AVX2-only CPU, one with AVX512-bf16,
one with AMX-bf16), and so do users'. On a CPU without bf16 units, torch emulates bf16 matmuls by
converting to fp32 and back: slower than fp32. With them (AMX tiles, or AVX512-bf16's dot products),
oneDNN runs bf16 matmuls faster than fp32 ones. A GPU from Ampere on does bf16 natively.

Only work whose result may differ in the last bits uses this: regenerating training data
(`regen.dtype: auto`, train/recipe.py) and, where asked, training under autocast. Serving keeps the
model's dtype (engine `dtype: auto`, engine/startup.py): outputs must equal the fp32 reference's.
"""

from __future__ import annotations

import torch


def default_device() -> str:
    """Where work goes when nothing says: the GPU when there is one."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def bf16_units(device: torch.device | str | None = None) -> str | None:
    """The name of `device`'s (default: `default_device()`) native bf16 unit (for logs and plans), or None
    where bf16 is emulated."""
    device = torch.device(device or default_device())
    if device.type == "cuda":
        return f"CUDA {torch.cuda.get_device_name(device)}" if torch.cuda.is_bf16_supported() else None
    if device.type != "cpu":
        return None
    cpu = getattr(torch, "cpu", None)
    probes = (("AMX-bf16", "_is_amx_tile_supported"), ("AVX512-bf16", "_is_avx512_bf16_supported"))
    for name, probe in probes:
        check = getattr(cpu, probe, None)
        if check is None:  # an older or newer torch without the probe: never assume the unit
            continue
        try:
            if check():
                return name
        except RuntimeError:
            continue
    return None


def fast_dtype(device: torch.device | str | None = None) -> str:
    """"bfloat16" where `device` has native bf16 units, else "float32" (the path every CPU has)."""
    return "bfloat16" if bf16_units(device) else "float32"
