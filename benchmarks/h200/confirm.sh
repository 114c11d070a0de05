#!/usr/bin/env bash
# Run on the lent 2 x H200 machine through the device tool, with .whl/ carried: batch-1
# latency of the committed tree at TP = 1 and TP = 2 (symmetric-memory all-reduce).
source benchmarks/h200/setup.sh
timeout 80 python3 -m agent_infer.cli bench latency --model $M8 --num-iters 3 --output-json $OUT/lat_tp1.json > $OUT/lat_tp1.log 2>&1; grep -E "decode tok/s|TTFT ms|iteration" $OUT/lat_tp1.log
timeout 90 python3 -m agent_infer.cli bench latency --model $M8 --tp 2 --num-iters 2 --output-json $OUT/lat_tp2.json > $OUT/lat_tp2.log 2>&1; grep -E "decode tok/s|TTFT ms" $OUT/lat_tp2.log
