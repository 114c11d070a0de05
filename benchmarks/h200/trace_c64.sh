#!/usr/bin/env bash
# Where the server loses throughput at concurrency 64 (issue 4): the server traced
# (server_trace.py), the load generator's CPU time, each step policy in turn.
# Carry .whl and .carry_tok.
source benchmarks/h200/setup.sh
cp .carry_tok/* $M8/
for P in "" "--mixed-batches"; do
  T=${P:+mixed}; T=${T:-plain}
  TRACE_OUT=$OUT/trace_$T.json python3 benchmarks/h200/server_trace.py --model $M8 --port 8011 --max-num-seqs 64 $P > $OUT/server_$T.log 2>&1 & SP=$!
  for i in $(seq 150); do curl -sf localhost:8011/health >/dev/null && break; sleep 1; done
  TIMEFORMAT="client: %U s user %S s sys %R s wall"
  time (timeout 80 python3 -m agent_infer.cli bench serve --base-url http://localhost:8011/v1 --max-concurrency 64 --num-prompts 256 --random-input-len 256 --random-output-len 256 --temperature 0 2>&1 | grep -E "Output token throughput|TTFT|ITL")
  awk '{print "server: " ($14+$15)/100 " s CPU (user+sys) so far"}' /proc/$SP/stat
  sleep 1.5; kill $SP; wait $SP 2>/dev/null
  python3 benchmarks/h200/server_trace.py analyze $OUT/trace_$T.json | tail -14
done
