#!/usr/bin/env bash
# Eighth session (kind nvidia-h200; carry .whl and .carry_ab with base.tar = git archive
# of the base; COMMIT=<sha> literally): GPU tests of the changed kernels, the
# throughput-workload kernel benchmark with its sweeps, then the workload itself, base and
# this tree alternating (2 rounds).
source benchmarks/h200/setup.sh
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels.py -k "norm_rope_store or gumbel" \
  > $OUT/kernel_tests.txt 2>&1; echo "kernel tests rc $?: $(tail -1 $OUT/kernel_tests.txt)"
timeout 240 python3 benchmarks/throughput_kernels.py > $OUT/throughput_kernels.txt 2>&1
echo "throughput_kernels rc $?"; grep -E "best|T=|float32|bfloat16|one layer|TB/s$" $OUT/throughput_kernels.txt | head -40
ab_throughput 2
