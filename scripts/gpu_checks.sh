#!/usr/bin/env bash
# The GPU checks in one run (a lent GPU machine has minutes, not hours): the `gpu` test marker
# (compiled Triton attention and fused MoE), the fp32 and bf16 fidelity suites with the engine on
# CUDA (transformers on CPU as the reference), then the real-size benchmark: omniserve with CUDA
# graphs, eager (and, with ENGINES=...,omniserve:torch, the torch attention backend) against
# transformers' batched generate on the same GPU. Logs land in $OUT (or ./gpu-checks).
#
#   bash scripts/gpu_checks.sh                 # on a machine with CUDA, omniserve installed
#   WHEELS=.whl bash scripts/gpu_checks.sh     # first install carried wheels (no registry there)
set -o pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-gpu-checks}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if [ -n "${WHEELS:-}" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$WHEELS"/*.whl && export PYTHONPATH=/tmp/site
  $PY -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton',
triton.__version__, 'transformers', transformers.__version__)"
MODELS=${MODELS:-qwen2.5-omni-3b-thinker}
LLM_KWARGS=${LLM_KWARGS:-'{}'}
# pytest: a per-test limit, and SIGINT at the end of the budget so it still prints its summary
PYTEST="$PY -m pytest -q -p no:cacheprovider -rfE --tb=short --timeout=${PER_TEST_TIMEOUT:-120}"
timeout -s INT "${TEST_TIMEOUT:-200}" $PYTEST -m gpu tests/test_triton_attention.py \
  tests/test_cuda_graph.py tests/test_triton_fused_moe.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
timeout -s INT "${TEST_TIMEOUT:-200}" $PYTEST --maxfail=3 tests/test_fidelity.py \
  tests/test_fidelity_bf16.py -k "not arithmetic" 2>&1 | tee "$OUT/fidelity.log" | tail -15
# the real-size checkpoints build on the CPUs after the tests (HF references run there too)
$PY -c "
from omniserve.checkpoint_builder import build_realsize_checkpoint
for name in '$MODELS'.split(','):
    print(name, build_realsize_checkpoint(name), flush=True)" 2>&1 | tail -2
timeout -s INT "${BENCH_TIMEOUT:-400}" $PY scripts/bench_realsize.py --models "$MODELS" \
  --engines "${ENGINES:-omniserve,omniserve:eager,hf}" \
  --variants '{"eager": {"enforce_eager": true}, "torch": {"enforce_eager": true, "attention_backend": "torch"}}' \
  --workloads "${WORKLOADS:-b1,b32,b128,ttft_mm}" \
  --engine-timeout "${ENGINE_TIMEOUT:-180}" --llm-kwargs "$LLM_KWARGS" \
  --out "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
