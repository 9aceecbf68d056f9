"""bf16 is chosen only where the CPU has bf16 units, found at run time; every other CPU keeps fp32."""

from pathlib import Path

import pytest
import torch

from tests.helpers.cpu import pretend_cpu
from tsengine.model import precision


@pytest.mark.parametrize("amx, avx512_bf16, unit", [(True, True, "AMX-bf16"), (False, True, "AVX512-bf16"),
                                                    (True, False, "AMX-bf16"), (False, False, None),
                                                    (None, None, None), (None, True, "AVX512-bf16")])
def test_the_unit_is_found_at_run_time(monkeypatch, amx, avx512_bf16, unit):
    pretend_cpu(monkeypatch, amx, avx512_bf16)
    assert precision.bf16_units("cpu") == unit
    assert precision.fast_dtype("cpu") == ("bfloat16" if unit else "float32")


def test_a_probe_that_fails_is_no_unit(monkeypatch):
    def broken():
        raise RuntimeError("cpuinfo unavailable")

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", broken, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", broken, raising=False)
    assert precision.bf16_units("cpu") is None


def test_this_machine_agrees_with_its_cpu_flags():
    """The probe against the kernel's own list of this CPU's features (Linux only)."""
    info = Path("/proc/cpuinfo")
    if not info.exists():
        pytest.skip("no /proc/cpuinfo to compare with")
    flags = set(next(x for x in info.read_text().splitlines() if x.startswith("flags")).split(":")[1].split())
    expected = "AMX-bf16" if "amx_tile" in flags else "AVX512-bf16" if "avx512_bf16" in flags else None
    assert precision.bf16_units("cpu") == expected
