#!/usr/bin/env bash
# Run on the lent 2 x H200 machine (kind nvidia-h200-x2) with .whl/ carried: the batch-1
# GEMV kernels, then TP = 2 batch-1 latency with the default all-reduce (symmetric memory,
# fused with add + RMSNorm) and with plain symmetric memory (ARS= to choose), then the
# TP = 2 token checks (fused, batched and batch 1) against TP = 1. Written for the GEMV
# all-reduce experiment of 2026-11-30 (docs/PERFORMANCE.md), which was dropped.
source benchmarks/h200/setup.sh
[ -n "$SKIP_KERNELS" ] || timeout 120 python3 -m pytest -q -x tests/gpu/test_kernels.py -k "gemv_m1" > $OUT/kernels.log 2>&1; tail -1 $OUT/kernels.log
for AR in ${ARS:-auto symm_mem}; do
  timeout 120 python3 -m agent_infer.cli -v bench latency --model $M8 --tp 2 --all-reduce $AR --num-iters 3 \
    --output-json $OUT/lat_tp2_$AR.json > $OUT/lat_tp2_$AR.log 2>&1
  echo "== $AR (rc $?)"; grep -E "all-reduce:|unavailable|decode tok/s|TTFT|Error" $OUT/lat_tp2_$AR.log | head -6
done
AGENT_INFER_TP_MODEL_DIR=$M8 timeout 330 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_tp_gpu.py -k fused \
  > $OUT/parity.log 2>&1; echo "parity rc $?"; grep -E "passed|failed|matched|alone|Error|assert" $OUT/parity.log | head -8
