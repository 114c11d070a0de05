#!/usr/bin/env bash
# Tenth session: the throughput workload three times in a row, each a fresh process, on
# the committed tree (kind nvidia-h200, carry .whl; COMMIT=<sha>; ~4 min). In every
# earlier call the first throughput run was the slowest; this shows how much on one machine.
source benchmarks/h200/setup.sh
for R in 1 2 3; do
  timeout 150 python3 -m agent_infer.cli bench throughput --model $M8 --output-json $OUT/s10_thr_rep_$R.json > /tmp/thr_$R.log 2>&1
  echo "round $R rc $?: $(grep -E 'output tok/s' /tmp/thr_$R.log | head -1)"
done
timeout 100 python3 -m agent_infer.cli bench latency --model $M8 --num-iters 3 --output-json $OUT/s10_lat_rep.json > /tmp/lat.log 2>&1
echo "batch 1: $(grep -E 'decode tok/s' /tmp/lat.log | head -1)"
