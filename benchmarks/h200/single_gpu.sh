#!/usr/bin/env bash
# Run on the lent H200 machine through the device tool, from the repository root, with
# missing wheels carried in .whl/ (fastapi, starlette, pydantic(-core), uvicorn, openai,
# gguf, opentelemetry-api, ...) and the default model's GGUF file carried in two halves
# (.carry_a/part00, .carry_b/part01: one call can carry 64 MiB). Figures: docs/PERFORMANCE.md.
# single-GPU checks and benchmarks (H200); outputs under $OUT
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export AGENT_INFER_CACHE=/tmp/aic AGENT_INFER_GIT_COMMIT=${COMMIT:-unknown}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
cp .carry_a/part00 /tmp/part00
timeout 120 python3 -m pytest -q tests/gpu/test_kernels.py -k gumbel 2>&1 | tail -3
timeout 170 python3 -m pytest -q tests/gpu/test_engine_gpu.py -k "not default" 2>&1 | tail -3
timeout 200 python3 -m agent_infer.cli bench latency --random-weights qwen3-8b --num-iters 3 --profile $OUT/pl --output-json $OUT/lat.json > $OUT/lat.log 2>&1; grep -A14 "^profile" $OUT/lat.log | head -16; tail -12 $OUT/lat.log
timeout 150 python3 -m agent_infer.cli bench throughput --random-weights qwen3-8b --profile $OUT/pt --output-json $OUT/thr8b.json > $OUT/thr8b.log 2>&1; grep -A12 "^profile" $OUT/thr8b.log | head -14; tail -10 $OUT/thr8b.log
timeout 100 python3 -m agent_infer.cli bench throughput --random-weights qwen3-0.6b --output-json $OUT/thr06b.json > $OUT/thr06b.log 2>&1; tail -9 $OUT/thr06b.log
