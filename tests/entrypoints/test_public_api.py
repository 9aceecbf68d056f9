"""The public API is importable from the package, as vLLM's is (`from tsengine import LLM, SamplingParams`),
and stays lazy: importing one record does not import the engine."""

import subprocess
import sys

import pytest

import tsengine


def test_the_public_names_are_the_modules_own():
    from tsengine import LLM, EngineConfig, SamplingParams, SpeculativeConfig
    from tsengine.config import EngineConfig as config_engine
    from tsengine.config import SpeculativeConfig as config_spec
    from tsengine.entrypoints.llm import LLM as llm_llm
    from tsengine.sampling_params import SamplingParams as params

    assert (LLM, SamplingParams, EngineConfig, SpeculativeConfig) == (llm_llm, params, config_engine, config_spec)
    assert set(tsengine.__all__) == {"LLM", "SamplingParams", "EngineConfig", "SpeculativeConfig", "__version__"}
    with pytest.raises(AttributeError, match="no attribute 'Engine'"):
        tsengine.Engine


def test_a_record_imports_without_the_engine():
    code = "import sys, tsengine.errors, tsengine.sampling_params; print(sorted(m for m in sys.modules if " \
           "m.startswith(('tsengine.engine', 'tsengine.entrypoints', 'torch._dynamo'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
