#!/usr/bin/env bash
# The server at concurrency 64 with the GIL switch interval of its process varied
# (issue 4: Triton launches release the GIL, and a busy event loop then holds it for up
# to one interval each time). Carry .whl and .carry_tok.
source benchmarks/h200/setup.sh
cp .carry_tok/* $M8/
for S in "" 1 0.2; do
  T=${S:-default}
  TRACE_OUT=$OUT/trace_$T.json python3 benchmarks/h200/server_trace.py --model $M8 --port 8011 --max-num-seqs 64 ${S:+--switch-interval-ms $S} > $OUT/server_$T.log 2>&1 & SP=$!
  for i in $(seq 150); do curl -sf localhost:8011/health >/dev/null && break; sleep 1; done
  echo "== switch interval: $T"
  timeout 80 python3 -m agent_infer.cli bench serve --base-url http://localhost:8011/v1 --max-concurrency 64 --num-prompts 256 --random-input-len 256 --random-output-len 256 --temperature 0 2>&1 | grep -E "Output token throughput|TTFT"
  sleep 1.5; kill $SP; wait $SP 2>/dev/null
  python3 benchmarks/h200/server_trace.py analyze $OUT/trace_$T.json | tail -2
done
