#!/usr/bin/env bash
# The GPU checks in one run (a lent GPU machine has minutes, not hours): the `gpu` test marker
# (the compiled Triton layer kernels, pinned uploads, CUDA-graph replays, the memory profile,
# fused MoE and attention), the bf16 and fp32 fidelity suites with the engine on CUDA
# (transformers on CPU as the reference), then the real-size benchmark per model: omniserve with
# CUDA graphs, synchronous and with async scheduling, and transformers' batched generate on the
# same GPU, with a step profile of each omniserve run. Logs land in $OUT (or ./gpu-checks).
#
#   bash scripts/gpu_checks.sh                 # on a machine with CUDA, omniserve installed
#   WHEELS=.whl bash scripts/gpu_checks.sh     # first install carried wheels (no registry there)
#   BENCH_FLAGS=--torch-profile bash ...       # more bench_realsize flags (--python-profile too)
#   ENGINES=omniserve,hf,omniserve:eager ...   # and the eager variant
#   ENGINES=omniserve,omniserve:sdpa_towers WORKLOADS=ttft_mm ...  # towers' packed attention
#   SAMPLING='{"temperature": 0.7, "top_p": 0.8, "repetition_penalty": 1.05}' ...  # not greedy
#   TEST_GROUPS="tests/a.py;tests/b.py" ...    # other GPU test groups; FIDELITY_TIMEOUT=0 skips
# The defaults fit one 10-minute call of a 15-minute loan: 2 minutes of tests, then 3 per model.
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
MODELS=${MODELS:-qwen2.5-omni-3b-thinker,qwen3-omni-30b-a3b-thinker-4l}
LLM_KWARGS=${LLM_KWARGS:-'{"max_num_seqs": 128}'}
# The real-size checkpoints build on a few CPU threads while the tests run (the HF references of
# the fidelity tests run on the CPUs too); the tests are stopped with SIGINT at their budget, so
# pytest still prints its summary.
OMP_NUM_THREADS=4 $PY -c "
from omniserve.checkpoint_builder import build_realsize_checkpoint
for name in '$MODELS'.split(','):
    print(name, build_realsize_checkpoint(name), flush=True)" >"$OUT/build.log" 2>&1 &
BUILD=$!
PYTEST="$PY -m pytest -q -p no:cacheprovider -rfE --tb=short --timeout=${PER_TEST_TIMEOUT:-120}"
# In groups (';'-separated in TEST_GROUPS), each with an equal share of what the groups before
# it left of the budget: a group stopped at its budget can lose its summary, and then only that
# group's.
TEST_GROUPS=${TEST_GROUPS:-"tests/test_cuda_kernels.py tests/test_transfers.py \
tests/test_sampler.py tests/test_memory.py tests/test_kernel_compiles.py \
tests/test_async_scheduling.py tests/test_encoder_inputs.py tests/test_encoder_attention.py \
tests/test_lora.py tests/test_spec_decode.py tests/test_quantization.py tests/test_fp8.py \
tests/test_quantized_experts.py;\
tests/test_cuda_graph.py;\
tests/test_triton_fused_moe.py tests/test_triton_attention.py"}
IFS=';' read -ra GROUPS_ <<<"$TEST_GROUPS"
(deadline=$(( SECONDS + ${TEST_TIMEOUT:-120} ))
for i in "${!GROUPS_[@]}"; do
  timeout -s INT $(( (deadline - SECONDS) / (${#GROUPS_[@]} - i) )) $PYTEST -m gpu ${GROUPS_[$i]}
done) >"$OUT/gpu_tests.log" 2>&1 &
GPU_TESTS=$!
# FIDELITY_TIMEOUT=0 skips the fidelity suites (their transformers references run on the CPUs).
FIDELITY_TIMEOUT=${FIDELITY_TIMEOUT:-${TEST_TIMEOUT:-120}}
if [ "$FIDELITY_TIMEOUT" -gt 0 ]; then
  timeout -s INT "$FIDELITY_TIMEOUT" $PYTEST --maxfail=3 tests/test_fidelity_bf16.py \
    tests/test_fidelity.py -k "not arithmetic" >"$OUT/fidelity.log" 2>&1 &
  FIDELITY=$!
fi
wait $GPU_TESTS; grep -E "passed|failed|FAILED|ERROR|Error" "$OUT/gpu_tests.log"
if [ -n "${FIDELITY:-}" ]; then wait $FIDELITY; tail -15 "$OUT/fidelity.log"; fi
wait $BUILD; tail -2 "$OUT/build.log"
timeout -s INT 60 $PY scripts/bench_kv_cache_dtype.py --contexts 1x8192,32x2048,128x1024 \
  2>&1 | tee "$OUT/bench-kv-cache-dtype.log"
# One model at a time, each with its own budget, so a slow first model leaves the second its time.
for name in ${MODELS//,/ }; do
  timeout -s INT "${BENCH_TIMEOUT:-180}" $PY scripts/bench_realsize.py --models "$name" \
    --engines "${ENGINES:-omniserve,omniserve:async,hf}" \
    --variants '{"async": {"async_scheduling": true}, "eager": {"enforce_eager": true}, "torch": {"enforce_eager": true, "attention_backend": "torch"}, "sdpa_towers": {"mm_encoder_attn_backend": "TORCH_SDPA"}}' \
    --workloads "${WORKLOADS:-b1,b32,b128,b1_long,ttft_mm}" --profile-steps ${BENCH_FLAGS:-} \
    --engine-timeout "${ENGINE_TIMEOUT:-100}" --llm-kwargs "$LLM_KWARGS" \
    --sampling "${SAMPLING:-{\}}" \
    --out "$OUT/bench-$name.json" 2>&1 | tee "$OUT/bench-$name.log"
done
