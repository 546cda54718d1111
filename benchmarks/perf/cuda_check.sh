#!/usr/bin/env bash
# The GPU check in one command, for a machine with a CUDA GPU, Triton and transformers:
#   OUT=/tmp/cuda-check bash benchmarks/perf/cuda_check.sh [quick|rest|all|short|verify]
# quick: the Triton kernels and the drop-in on CUDA against their oracles (all but the two
#        every-pair tests), then `pagedkv bench attention --device cuda` (headline shape, six
#        formats) and benchmarks/perf/cuda_dropin_step.py;
# rest:  the every-pair decode / prefill tests and the remaining bench formats;
# short: a shorter pass of both (bf16-operand bench rows only, fewer decode steps; ~9 min);
# verify: the checks only (drop-in, kernels, every pair) and two bf16-operand bench rows (~8 min).
# Each phase has its own time limit, so a slow phase leaves the next ones their turn; logs in $OUT.
set -u
PHASE=${1:-quick}
OUT=${OUT:-/tmp/cuda-check}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
T=(-q -p no:cacheprovider -rfE)

phase() {  # name, seconds, command...
  local name=$1 secs=$2; shift 2
  echo "=== $name (limit ${secs}s) $(date -u +%T)"
  local t0=$SECONDS
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 40 "$OUT/$name.log"
  echo "=== $name: rc $rc in $((SECONDS - t0))s"
}

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $PY -c "import torch, triton, transformers; print('torch', torch.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__)"
  nproc; } 2>&1 | tee "$OUT/env.txt"

if [ "$PHASE" = quick ] || [ "$PHASE" = all ]; then
  phase dropin_tests 120 $PY -m pytest "${T[@]}" -s tests/test_cuda_dropin.py
  phase kernel_tests 100 $PY -m pytest "${T[@]}" -n 8 tests/test_triton.py tests/test_triton_latent.py \
    tests/test_codec_support.py tests/test_ops_api.py -k "not every_pair and not prefill_pairs"
  phase bench_attention 120 $PY -m pagedkv.cli.main bench attention --device cuda \
    --formats bf16,fp8,q8_0,turbo4,turbo3,turbo2
  phase dropin_step 60 $PY benchmarks/perf/cuda_dropin_step.py --contexts 1k,8k --batches 1,16 \
    --formats bf16,turbo3,turbo4+r32s16q8_0
fi
if [ "$PHASE" = short ]; then  # about 9 minutes in all: the checks and the bench's bf16 rows only
  phase dropin_tests 100 $PY -m pytest "${T[@]}" -s tests/test_cuda_dropin.py
  phase kernel_tests 90 $PY -m pytest "${T[@]}" -n 8 tests/test_triton.py tests/test_triton_latent.py \
    tests/test_codec_support.py tests/test_ops_api.py -k "not every_pair and not prefill_pairs"
  phase bench_attention 90 $PY -m pagedkv.cli.main bench attention --device cuda --precisions bf16 \
    --formats bf16,q4_0,turbo4,turbo3,turbo2,nvfp4,fp8k_turbo3v
  phase dropin_step 50 $PY benchmarks/perf/cuda_dropin_step.py --contexts 1k,8k --batches 1,16 \
    --formats bf16,turbo3 --steps 10
  phase pair_tests 200 $PY -m pytest "${T[@]}" -n 12 tests/test_triton.py -k "every_pair or prefill_pairs"
fi
if [ "$PHASE" = verify ]; then
  phase dropin_tests 100 $PY -m pytest "${T[@]}" -s tests/test_cuda_dropin.py
  phase kernel_tests 90 $PY -m pytest "${T[@]}" -n 8 tests/test_triton.py tests/test_triton_latent.py \
    tests/test_codec_support.py tests/test_ops_api.py -k "not every_pair and not prefill_pairs"
  phase pair_tests 200 $PY -m pytest "${T[@]}" -n 12 tests/test_triton.py -k "every_pair or prefill_pairs"
  phase bench_attention 60 $PY -m pagedkv.cli.main bench attention --device cuda --precisions bf16 \
    --formats turbo3,fp8k_turbo3v
fi
if [ "$PHASE" = rest ] || [ "$PHASE" = all ]; then
  phase pair_tests 240 $PY -m pytest "${T[@]}" -n 12 tests/test_triton.py -k "every_pair or prefill_pairs"
  phase bench_attention_rest 90 $PY -m pagedkv.cli.main bench attention --device cuda \
    --formats turbo8,fp8k_turbo3v,nvfp4,q4_0
fi
