#!/usr/bin/env bash
# Seventh session's closing run on 2 x H200 (.whl/ and .carry_tok/ carried, COMMIT=<sha>):
# the committed tree's TP = 2 batch-1 latency, the TP = 2 token checks, the engine GPU
# tests (HF closeness, graphs against eager; decode attention changed), and the server
# with --tp 2 (a streaming request, bench serve at concurrency 8). ~7 min.
source benchmarks/h200/setup.sh
timeout 110 python3 -m agent_infer.cli -v bench latency --model $M8 --tp 2 --num-iters 3 --output-json $OUT/tp2_latency.json > /tmp/tp2.log 2>&1
echo "tp2_latency: $(grep -E 'decode tok/s' /tmp/tp2.log | head -1 | cut -c1-60) $(grep -o 'all-reduce: [^|]*' /tmp/tp2.log | head -1 | cut -c1-60)"
AGENT_INFER_TP_MODEL_DIR=$M8 timeout 150 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_tp_gpu.py -k fused > $OUT/parity.txt 2>&1
echo "parity rc $?: $(grep -E 'matched|alone|passed|failed' $OUT/parity.txt | tr '\n' ' ' | cut -c1-220)"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_engine_gpu.py > $OUT/engine_gpu.txt 2>&1
echo "engine gpu rc $?: $(tail -1 $OUT/engine_gpu.txt)"
cp .carry_tok/* $M8/
python3 -m agent_infer.cli serve --model $M8 --port 8011 --tp 2 --max-num-seqs 16 > /tmp/server_tp2.log 2>&1 & SP=$!
for i in $(seq 150); do curl -sf localhost:8011/health >/dev/null && break; sleep 1; done
curl -sN localhost:8011/v1/completions -H 'content-type: application/json' -d '{"model":"qwen3-8b","prompt":"Hello","max_tokens":8,"stream":true}' > $OUT/stream.txt; head -c 200 $OUT/stream.txt; echo
timeout 80 python3 -m agent_infer.cli bench serve --base-url http://localhost:8011/v1 --max-concurrency 8 --num-prompts 32 --random-input-len 256 --random-output-len 256 --temperature 0 --result-json $OUT/serve_tp2_c8.json 2>&1 | grep -E "Successful|Output token throughput|TPOT|error"
kill $SP; wait $SP 2>/dev/null
