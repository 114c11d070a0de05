#!/usr/bin/env bash
# Tenth session: the throughput workload with the bf16 KV cache (default) and with
# --kv-cache-dtype fp8, alternating, each a fresh process, two rounds; then batch 1 with
# each (kind nvidia-h200, carry .whl; COMMIT=<sha>; ~6 min).
source benchmarks/h200/setup.sh
for R in 1 2; do
  for V in $( [ $R = 1 ] && echo auto fp8 || echo fp8 auto ); do
    timeout 150 python3 -m agent_infer.cli bench throughput --model $M8 --kv-cache-dtype $V \
      --output-json $OUT/s10_thr_kv_${V}_$R.json > /tmp/thr_${V}_$R.log 2>&1
    echo "throughput kv $V round $R rc $?: $(grep -E 'output tok/s' /tmp/thr_${V}_$R.log | head -1)"
  done
done
for V in auto fp8; do
  timeout 100 python3 -m agent_infer.cli bench latency --model $M8 --num-iters 3 --kv-cache-dtype $V \
    --output-json $OUT/s10_lat_kv_$V.json > /tmp/lat_$V.log 2>&1
  echo "batch 1 kv $V: $(grep -E 'decode tok/s' /tmp/lat_$V.log | head -1)"
done
