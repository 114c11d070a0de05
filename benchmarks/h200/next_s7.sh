#!/usr/bin/env bash
# For the next session's first device call (kind nvidia-h200-x2, .whl/ carried,
# COMMIT=<sha>): what the sixth session could not run on its last tree (~8 min).
# 1. The 2-GPU fused all-reduce kernel test, which hung at dded417 (call count read before
#    the PDL wait) and was fixed in abb4579 without a GPU.
# 2. TP = 2 batch-1 latency of the fixed tree (395.1 tok/s at dded417).
# 3. TP = 1 batch-1 latency with transformers in the same process (the 20x criterion).
# 4. The throughput workload (9,587.4 tok/s at 4ebd24c; decode attention has changed since).
source benchmarks/h200/setup.sh
timeout 100 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_fused_allreduce_gpu.py > $OUT/fused_test.txt 2>&1
echo "fused kernel test rc $?: $(grep -E 'us per norm|passed|failed' $OUT/fused_test.txt | tr '\n' ' ')"
timeout 110 python3 -m agent_infer.cli bench latency --model $M8 --tp 2 --num-iters 3 --output-json $OUT/tp2_latency.json > /tmp/tp2.log 2>&1
echo "tp2: $(grep -E 'decode tok/s' /tmp/tp2.log | head -1 | cut -c1-70)"
timeout 200 python3 -m agent_infer.cli bench latency --model $M8 --num-iters 3 --compare-hf --output-json $OUT/tp1_latency_hf.json > /tmp/tp1.log 2>&1
echo "tp1:"; grep -E 'decode tok/s|TTFT' /tmp/tp1.log | head -3 | cut -c1-110
timeout 150 python3 -m agent_infer.cli bench throughput --model $M8 --output-json $OUT/throughput.json > /tmp/thr.log 2>&1
echo "throughput:"; grep -E 'output tok/s' /tmp/thr.log | head -2
