#!/usr/bin/env bash
# Run on the lent 2 x H200 machine (kind nvidia-h200-x2) from the repository root with
# .whl/ and .carry_ab/ carried, where
#   git archive -o .carry_ab/base.tar <base>
# A/B of loading before the PDL wait what does not depend on the predecessor kernel
# (decode attention: context length, block table and all keys of the first tile but the
# newest; RoPE + KV write: position, cos/sin, slot, norm weights; fused all-reduce: call
# count, norm weight): the kernel and engine GPU tests on this tree, then batch-1 latency
# at TP = 1 and TP = 2 for base and this tree, alternating (~7 min).
source benchmarks/h200/setup.sh
timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_kernels.py -k "decode or rope or gemv_m1 or cuda_graph" > $OUT/kernels.log 2>&1
echo "kernel tests: $(tail -1 $OUT/kernels.log)"
timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_engine_gpu.py > $OUT/engine.log 2>&1
echo "engine tests: $(tail -1 $OUT/engine.log)"
ab_latency "1 2"
