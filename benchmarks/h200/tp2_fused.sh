#!/usr/bin/env bash
# Run on the lent 2 x H200 machine (kind nvidia-h200-x2) through the device tool, from the
# repository root with .whl/ carried: the fused all-reduce + residual add + RMSNorm kernel
# (--all-reduce symm_mem_fused; first run on a GPU on 2026-11-30, now the default of auto).
#   bash benchmarks/h200/tp2_fused.sh          # test, then latency of both modes (~6-8 min)
#   bash benchmarks/h200/tp2_fused.sh test     # only the 2-GPU kernel test
#   bash benchmarks/h200/tp2_fused.sh bench    # only the latency runs (PROFILE=1: with --profile)
#   bash benchmarks/h200/tp2_fused.sh parity   # engine tokens: fused vs TP = 1 and vs symm_mem (~4 min)
# Batch-1 TP = 2 decode of the Qwen3-8B-shape model: 326 tok/s with symm_mem, target 380.
source benchmarks/h200/setup.sh
PART=${1:-all}
if [ "$PART" = parity ]; then
  AGENT_INFER_TP_MODEL_DIR=$M8 timeout 500 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_tp_gpu.py -k fused \
    > $OUT/fused_parity.log 2>&1
  echo "parity rc $?"; grep -E "passed|failed|matched|Error|assert" $OUT/fused_parity.log | head -8
  exit 0
fi
if [ "$PART" != bench ]; then
  timeout 280 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_fused_allreduce_gpu.py > $OUT/fused_test.log 2>&1
  echo "test rc $?"
  grep -E "passed|failed|skipped|programs at most|bit-unequal|back-to-back calls|CUDA graph|signal pad|us per norm|Error|assert" $OUT/fused_test.log | head -24
fi
if [ "$PART" != test ]; then
  for AR in symm_mem symm_mem_fused; do
    P=""; [ "${PROFILE:-0}" = 1 ] && P="--profile $OUT/p_$AR"
    timeout 130 python3 -m agent_infer.cli -v bench latency --model $M8 --tp 2 --all-reduce $AR --num-iters 3 $P \
      --output-json $OUT/lat_tp2_$AR.json > $OUT/lat_tp2_$AR.log 2>&1
    echo "== $AR (rc $?)"
    grep -E "all-reduce:|fused all-reduce|decode tok/s|decode step|TTFT|Error" $OUT/lat_tp2_$AR.log | head -8
    [ -n "$P" ] && grep -A12 "^profile" $OUT/lat_tp2_$AR.log | head -13
  done
fi
