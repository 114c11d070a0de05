#!/usr/bin/env bash
# Seventh session (kind nvidia-h200, .whl/ and .carry_ab/ carried, COMMIT=<sha>,
# .carry_ab/base.tar = git archive 4ebd24c): the throughput workload of this tree against
# 4ebd24c (9,587 tok/s in the fifth session) in the same call, alternating, two rounds;
# then this tree's batch-1 latency (~6 min).
source benchmarks/h200/setup.sh
ab_throughput 2
timeout 110 python3 -m agent_infer.cli bench latency --model $M8 --num-iters 3 --output-json $OUT/tp1_latency.json > /tmp/tp1.log 2>&1
echo "tp1: $(grep -E 'decode tok/s' /tmp/tp1.log | head -1)"
