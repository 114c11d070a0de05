#!/usr/bin/env bash
# Run on the lent H200 machine through the device tool, from the repository root, with
# missing wheels carried in .whl/ (fastapi, starlette, pydantic(-core), uvicorn, openai,
# gguf, opentelemetry-api, ...) and the default model's GGUF file carried in two halves
# (.carry_a/part00, .carry_b/part01: one call can carry 64 MiB). Figures: docs/PERFORMANCE.md.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export AGENT_INFER_CACHE=/tmp/aic AGENT_INFER_GIT_COMMIT=${COMMIT:-unknown}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
M8=/tmp/aic/random/qwen3-8b
[ -d $M8 ] || timeout 120 python3 -c "from agent_infer.bench.random_weights import ensure_random_model as e; e('qwen3-8b')"
SMOL=/tmp/aic/models/SmolLM2-135M-Instruct
[ -d $SMOL ] && AGENT_INFER_DEFAULT_MODEL_DIR=$SMOL timeout 90 python3 -m pytest -q -s tests/gpu/test_engine_gpu.py -k default 2>&1 | grep -E "passed|failed|matched|Error" | head -5
serve() { python3 -m agent_infer.cli serve --model $M8 --port 8011 --max-num-seqs 64 "$@" > $OUT/server$1.log 2>&1 & SP=$!; for i in $(seq 150); do curl -sf localhost:8011/health >/dev/null && break; sleep 1; done; }
serve
for C in 1 8 64; do N=$((C*4)); [ $C = 1 ] && N=4
  timeout 80 python3 -m agent_infer.cli bench serve --base-url http://localhost:8011/v1 --max-concurrency $C --num-prompts $N --random-input-len 256 --random-output-len 256 --temperature 0 --result-json $OUT/serve_c$C.json 2>&1 | tail -13
done
curl -s localhost:8011/metrics | grep -E "^agent_infer_(batch|num_requests|kv)" | head -8
kill $SP; wait $SP 2>/dev/null
serve --tp 2
curl -sN localhost:8011/v1/completions -H 'content-type: application/json' -d '{"model":"qwen3-8b","prompt":[1,2,3,4,5],"max_tokens":6,"stream":true,"ignore_eos":true}' | head -c 900; echo
timeout 60 python3 -m agent_infer.cli bench serve --base-url http://localhost:8011/v1 --max-concurrency 8 --num-prompts 16 --random-input-len 256 --random-output-len 128 --temperature 0 --result-json $OUT/serve_tp2_c8.json 2>&1 | tail -12
kill $SP; wait $SP 2>/dev/null
