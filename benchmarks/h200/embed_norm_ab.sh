#!/usr/bin/env bash
# Ran in the seventh session (+0.3 %, merged as ac883f7; docs/PERFORMANCE.md). Was run
# from branch wip/embed-norm on the lent 2 x H200 machine (kind
# nvidia-h200-x2) from this branch's root with .whl/ and .carry_ab/ carried, where
#   git archive -o .carry_ab/base.tar main     # the tree to compare against
# A/B of the embedding's all-reduce joined with the first layer's RMSNorm (one fused
# kernel instead of PyTorch's one-shot all-reduce + the norm): the 2-GPU fused all-reduce
# test on this tree (it now covers the no-add case), the TP = 2 token checks, then TP = 2
# batch-1 latency of base and this tree, alternating, two rounds (~7 min).
source benchmarks/h200/setup.sh
timeout 100 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_fused_allreduce_gpu.py > $OUT/fused_test.txt 2>&1
echo "fused kernel test rc $?: $(grep -E 'bit-unequal|us per norm|passed|failed' $OUT/fused_test.txt | tr '\n' ' ')"
AGENT_INFER_TP_MODEL_DIR=$M8 timeout 150 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_tp_gpu.py -k fused > $OUT/parity.txt 2>&1
echo "parity rc $?: $(grep -E 'matched|alone|passed|failed' $OUT/parity.txt | tr '\n' ' ' | cut -c1-220)"
ab_latency 2 2
