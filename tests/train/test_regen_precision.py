"""The recipe's `auto` precisions resolve from the CPU's bf16 units, found at run time: bf16 where the CPU
has AMX-bf16 or AVX512-bf16, fp32 on every other CPU; the user's explicit choice holds either way. A bf16
regeneration is cached apart from an fp32 one (its answers may differ)."""

from pathlib import Path

from tests.helpers.cpu import pretend_cpu
from tsengine.train.recipe import Optim, Regen, load

REPO = Path(__file__).resolve().parents[2]


def test_an_avx2_only_cpu_regenerates_and_trains_in_fp32(monkeypatch):
    pretend_cpu(monkeypatch, False, False)
    assert Regen().engine_dtype("cpu") == "float32" and Optim().precision("cpu") == "no"
    pretend_cpu(monkeypatch, None, None)  # a torch without the probes: nothing is assumed
    assert Regen().engine_dtype("cpu") == "float32" and Optim().precision("cpu") == "no"


def test_a_cpu_with_bf16_units_regenerates_and_trains_in_bf16(monkeypatch):
    for amx, avx512_bf16 in ((True, True), (False, True)):
        pretend_cpu(monkeypatch, amx, avx512_bf16)
        assert Regen().engine_dtype("cpu") == "bfloat16" and Optim().precision("cpu") == "bf16"


def test_the_users_choice_holds_on_any_cpu(monkeypatch):
    for units in (True, False):
        pretend_cpu(monkeypatch, units, units)
        assert Regen(dtype="float32").engine_dtype("cpu") == "float32"
        assert Regen(dtype="bfloat16").engine_dtype("cpu") == "bfloat16"
        assert Optim(mixed_precision="no").precision("cpu") == "no"
    assert Optim().precision("cuda") == "bf16"


def test_bf16_answers_are_cached_apart_from_fp32_ones(monkeypatch):
    pretend_cpu(monkeypatch, False, False)
    def _regen_settings(g):  # what the capture stage's cache key holds of the regen section
        return g.cache_fields({"batch_size", "samples_per_prompt", "include_greedy"})

    fp32 = _regen_settings(Regen())
    assert "dtype" not in fp32  # the key runs had before the field existed
    assert _regen_settings(Regen(dtype="float32")) == fp32
    assert _regen_settings(Regen(dtype="bfloat16")) == {**fp32, "dtype": "bfloat16"}


def test_a_bare_no_on_the_command_line_means_fp32():
    """YAML reads `no` as false; `train.mixed_precision=no` is still the user's fp32."""
    r = load(str(REPO / "recipes" / "smollm2-135m.yaml"), ["train.mixed_precision=no", "regen.dtype=float32"])
    assert r.train.mixed_precision == "no" and r.train.precision("cpu") == "no"
    assert r.regen.engine_dtype("cpu") == "float32"
