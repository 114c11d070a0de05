#!/usr/bin/env bash
# Seventh session (kind nvidia-h200-x2, .whl/ carried, COMMIT=<sha>): the decode-attention
# residency fix. At 685b2d3 the throughput workload fell to 8,665 tok/s (9,587 at 4ebd24c):
# the first-tile preload held registers at every batch size. Now it is taken only for
# one-wave grids. Checks: sm_90 register counts on this host's Triton, the decode kernel
# tests, the kernel alone with and without the preload, throughput, batch-1 latency.
source benchmarks/h200/setup.sh
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_compile.py tests/gpu/test_kernels.py -k "compile or sm90 or decode" > $OUT/kernel_tests.txt 2>&1
echo "kernel tests rc $?: $(tail -1 $OUT/kernel_tests.txt)"
timeout 120 python3 benchmarks/decode_residency.py > $OUT/decode_residency.txt 2>&1; cat $OUT/decode_residency.txt | tail -9
timeout 150 python3 -m agent_infer.cli bench throughput --model $M8 --output-json $OUT/throughput.json > /tmp/thr.log 2>&1
echo "throughput: $(grep -E 'output tok/s' /tmp/thr.log | head -1)"
timeout 110 python3 -m agent_infer.cli bench latency --model $M8 --num-iters 3 --output-json $OUT/tp1_latency.json > /tmp/tp1.log 2>&1
echo "tp1: $(grep -E 'decode tok/s' /tmp/tp1.log | head -1)"
timeout 110 python3 -m agent_infer.cli bench latency --model $M8 --tp 2 --num-iters 3 --output-json $OUT/tp2_latency.json > /tmp/tp2.log 2>&1
echo "tp2: $(grep -E 'decode tok/s' /tmp/tp2.log | head -1)"
