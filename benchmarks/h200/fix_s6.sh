#!/usr/bin/env bash
# Run on the lent 2 x H200 machine with .whl/ carried, after final_s6.sh found the 2-GPU
# fused all-reduce test hanging (the call count read before the PDL wait, while the
# previous call, launched just before in a graph, had yet to write it): that test, then
# TP = 2 batch-1 latency of the fixed tree (~3 min).
source benchmarks/h200/setup.sh
timeout 80 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_fused_allreduce_gpu.py > $OUT/fused_test.txt 2>&1
echo "fused kernel test rc $?: $(grep -E 'us per norm|passed|failed|not-arrived|graph' $OUT/fused_test.txt | tr '\n' ' ')"
timeout 90 python3 -m agent_infer.cli -v bench latency --model $M8 --tp 2 --num-iters 3 --output-json $OUT/tp2_latency.json > /tmp/tp2.log 2>&1
echo "tp2: $(grep -E 'decode tok/s' /tmp/tp2.log | head -1 | cut -c1-60)"
