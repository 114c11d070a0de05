#!/usr/bin/env bash
# Run on the lent 2 x H200 machine through the device tool, with .whl/ carried: the TP GPU
# tests (TP = 2 against TP = 1 on the Qwen3-8B-shape checkpoint), batch-1 TP = 2 latency
# with the symmetric-memory all-reduce and with NCCL (profiles of both), and the server
# with --tp 2 (a streamed request, bench serve at concurrency 8).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export AGENT_INFER_CACHE=/tmp/aic AGENT_INFER_GIT_COMMIT=${COMMIT:-unknown}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
M8=/tmp/aic/random/qwen3-8b
[ -d $M8 ] || timeout 150 python3 -c "from agent_infer.bench.random_weights import ensure_random_model as e; e('qwen3-8b')" > $OUT/w.log 2>&1
for AR in auto nccl; do
  timeout 120 python3 -m agent_infer.cli -v bench latency --model $M8 --tp 2 --all-reduce $AR --num-iters 2 --profile $OUT/p_$AR --output-json $OUT/lat_tp2_$AR.json > $OUT/lat_tp2_$AR.log 2>&1
  grep -E "all-reduce:" $OUT/lat_tp2_$AR.log | head -1; grep -A12 "^profile" $OUT/lat_tp2_$AR.log | head -13; grep -E "decode tok/s|decode step|TTFT|peak memory" $OUT/lat_tp2_$AR.log
done
AGENT_INFER_TP_MODEL_DIR=$M8 timeout 220 python3 -m pytest -q -s tests/gpu/test_tp_gpu.py 2>&1 | grep -E "passed|failed|matched|chosen|allocated|Error" | head -8
python3 -m agent_infer.cli serve --model $M8 --port 8011 --max-num-seqs 64 --tp 2 > $OUT/server_tp2.log 2>&1 & SP=$!
for i in $(seq 150); do curl -sf localhost:8011/health >/dev/null && break; sleep 1; done
curl -sN localhost:8011/v1/completions -H 'content-type: application/json' -d '{"model":"qwen3-8b","prompt":[1,2,3,4,5],"max_tokens":6,"stream":true,"ignore_eos":true}' | head -c 900; echo
timeout 60 python3 -m agent_infer.cli bench serve --base-url http://localhost:8011/v1 --max-concurrency 8 --num-prompts 16 --random-input-len 256 --random-output-len 128 --temperature 0 --result-json $OUT/serve_tp2_c8.json 2>&1 | grep -E "Successful|Output token throughput|TTFT|TPOT|ITL|E2E"
kill $SP; wait $SP 2>/dev/null
