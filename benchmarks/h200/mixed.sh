#!/usr/bin/env bash
# Prefill-only steps against --mixed-batches on one
# H200, with .whl/ and .carry_tok (SmolLM2's tokenizer files) carried. 1. The nano-vllm
# throughput workload, Qwen3-8B shape. 2. The server at concurrency 64 against offline at
# the same batch (the issue-4 overhead), each policy in turn.
source benchmarks/h200/setup.sh
cp .carry_tok/* $M8/
for P in "" "--mixed-batches"; do
  T=${P:+mixed}; T=${T:-plain}
  timeout 100 python3 -m agent_infer.cli bench throughput --model $M8 $P --output-json $OUT/thr_$T.json 2>&1 | grep -E "output tok/s"
  timeout 100 python3 -m agent_infer.cli bench throughput --model $M8 $P --num-seqs 256 --min-len 256 --max-len 256 --max-num-seqs 64 --temperature 0 --output-json $OUT/offline_c64_$T.json 2>&1 | grep -E "output tok/s"
  python3 -m agent_infer.cli serve --model $M8 --port 8011 --max-num-seqs 64 $P > $OUT/server_$T.log 2>&1 & SP=$!
  for i in $(seq 150); do curl -sf localhost:8011/health >/dev/null && break; sleep 1; done
  TIMEFORMAT="load generator: %U s user %S s sys %R s wall"
  time timeout 80 python3 -m agent_infer.cli bench serve --base-url http://localhost:8011/v1 --max-concurrency 64 --num-prompts 256 --random-input-len 256 --random-output-len 256 --temperature 0 --result-json $OUT/serve_c64_$T.json 2>&1 | grep -E "Successful|Output token throughput|TTFT|TPOT|ITL"
  curl -s localhost:8011/metrics | grep -E '^agent_infer_(decode_batch_size|prefill_batch_tokens|step_seconds)_(sum|count)' > $OUT/metrics_$T.txt
  kill $SP; wait $SP 2>/dev/null
done
