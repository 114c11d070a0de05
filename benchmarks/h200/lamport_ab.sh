#!/usr/bin/env bash
# Run on the lent 2 x H200 machine (kind nvidia-h200-x2) from the repository root with
# .whl/ and .carry_ab/ carried, where
#   git archive -o .carry_ab/base.tar <base>     # the flag-barrier fused all-reduce
# A/B of the fused all-reduce + add + RMSNorm exchanging rows through not-arrived marks
# (no barrier) against the flag barrier: the 2-GPU kernel test on this tree (with its
# micro-benchmark), TP = 2 batch-1 latency of base and this tree, alternating, then the
# engine's TP = 2 token checks on this tree (~8 min).
source benchmarks/h200/setup.sh
timeout 200 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_fused_allreduce_gpu.py > $OUT/fused_test.log 2>&1
echo "kernel test rc $?"; grep -E "passed|failed|bit-unequal|back-to-back|CUDA graph|not-arrived|us per norm|Error|assert" $OUT/fused_test.log | head -12
ab_latency 2 2
AGENT_INFER_TP_MODEL_DIR=$M8 timeout 200 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_tp_gpu.py -k fused \
  > $OUT/parity.log 2>&1; echo "parity rc $?"; grep -E "passed|failed|matched|alone|Error|assert" $OUT/parity.log | head -6
