#!/usr/bin/env bash
# Run on the lent 2 x H200 machine with .whl/ and .carry_tok/ carried: the fifth session's
# closing figures of the committed tree: TP = 1 and TP = 2 batch-1 latency (default
# all-reduce: symmetric memory fused with add + RMSNorm), the TP = 2 token checks, and the
# server with --tp 2 at concurrency 8.
source benchmarks/h200/setup.sh
timeout 100 python3 -m agent_infer.cli bench latency --model $M8 --num-iters 3 --output-json $OUT/lat_tp1.json > $OUT/lat_tp1.log 2>&1
echo "tp1: $(grep -E 'decode tok/s' $OUT/lat_tp1.log | head -1)"
timeout 120 python3 -m agent_infer.cli -v bench latency --model $M8 --tp 2 --num-iters 3 --output-json $OUT/lat_tp2.json > $OUT/lat_tp2.log 2>&1
grep -E "all-reduce:" $OUT/lat_tp2.log | head -1; echo "tp2: $(grep -E 'decode tok/s' $OUT/lat_tp2.log | head -1)"; grep -E "peak memory" $OUT/lat_tp2.log
cp .carry_tok/* $M8/
python3 -m agent_infer.cli serve --model $M8 --port 8011 --tp 2 --max-num-seqs 16 > $OUT/server_tp2.log 2>&1 & SP=$!
for i in $(seq 150); do curl -sf localhost:8011/health >/dev/null && break; sleep 1; done
curl -sN localhost:8011/v1/completions -H 'content-type: application/json' -d '{"model":"m","prompt":"Hello","max_tokens":8,"stream":true}' | head -c 400; echo
timeout 80 python3 -m agent_infer.cli bench serve --base-url http://localhost:8011/v1 --max-concurrency 8 --num-prompts 32 --random-input-len 256 --random-output-len 256 --temperature 0 --result-json $OUT/serve_tp2_c8.json 2>&1 | grep -E "Successful|Output token throughput|TPOT|error"
kill $SP; wait $SP 2>/dev/null
AGENT_INFER_TP_MODEL_DIR=$M8 timeout 200 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_tp_gpu.py -k fused \
  > $OUT/parity.log 2>&1; echo "parity rc $?"; grep -E "passed|failed|matched|alone|Error|assert" $OUT/parity.log | head -6
