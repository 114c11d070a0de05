#!/usr/bin/env bash
# Run on the lent H200 machine through the device tool, from the repository root, with the
# wheels of .whl/ and the first half of the default model's GGUF (.carry_a/part00) carried
# (third session of 2026-11-29): kernel tests, then batch-1 Qwen3-8B latency against
# transformers, a per-kernel profile with PDL off, and the eager figure.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export AGENT_INFER_CACHE=/tmp/aic AGENT_INFER_GIT_COMMIT=${COMMIT:-unknown}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
[ -f .carry_a/part00 ] && cp .carry_a/part00 /tmp/part00
(timeout 150 python3 -c "from agent_infer.bench.random_weights import ensure_random_model as e; e('qwen3-8b')" > $OUT/w.log 2>&1) &
timeout 220 python3 -m pytest -q -x tests/gpu/test_kernels.py 2>&1 | tail -4
wait
B="python3 -m agent_infer.cli bench latency --random-weights qwen3-8b"
timeout 200 $B --num-iters 3 --compare-hf --hf-iters 1 --output-json $OUT/lat.json > $OUT/lat.log 2>&1; tail -14 $OUT/lat.log
AGENT_INFER_PDL=0 timeout 100 $B --num-iters 2 --profile $OUT/pl --output-json $OUT/lat_nopdl.json > $OUT/lat_nopdl.log 2>&1; grep -A16 "^profile" $OUT/lat_nopdl.log | head -18; grep -E "decode tok/s" $OUT/lat_nopdl.log
timeout 80 $B --num-iters 1 --enforce-eager --output-json $OUT/lat_eager.json > $OUT/lat_eager.log 2>&1; grep -E "decode tok/s|TTFT" $OUT/lat_eager.log
