"""On a CUDA device (bench/gpu_check.sh runs these on a lent GPU; without one they are skipped, never
passed): the Triton attention kernels compiled, not interpreted, in fp32 and bf16, and speculation lossless
there as on the CPU."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.engine import PROMPTS
from tsengine.entrypoints.llm import LLM
from tsengine.sampling_params import SamplingParams

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (bench/gpu_check.sh)")]

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _tokens(tiny_dirs, spec=None, **kw) -> list[list[int]]:
    llm = LLM(str(tiny_dirs["llama"]), speculative_config=spec, device="cuda", block_size=16, debug_checks=True, **kw)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_triton_backend_equals_torch_backend_fp32(tiny_dirs):
    assert _tokens(tiny_dirs, dtype="float32", attention_backend="triton") == \
        _tokens(tiny_dirs, dtype="float32", attention_backend="torch")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", [(3, 1, 4), (3, 2, 6)])
def test_speculation_is_lossless_on_gpu(tiny_dirs, heads, dtype, shape):
    steps, topk, nodes = shape
    spec = {"method": "eagle3", "model": str(heads["llama"]), "num_speculative_tokens": steps,
            "adaptive": False, "eagle_topk": topk,
            "num_draft_tokens": nodes}
    plain = _tokens(tiny_dirs, dtype=dtype, attention_backend="triton")
    assert _tokens(tiny_dirs, spec, dtype=dtype, attention_backend="triton") == plain
