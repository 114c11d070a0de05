#!/usr/bin/env bash
# Run on the lent 2 x H200 machine through the device tool, with .whl/ carried: batch-1
# latency of the committed tree at TP = 1 and TP = 2 (symmetric-memory all-reduce).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export AGENT_INFER_CACHE=/tmp/aic AGENT_INFER_GIT_COMMIT=${COMMIT:-unknown}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
M8=/tmp/aic/random/qwen3-8b
[ -d $M8 ] || timeout 150 python3 -c "from agent_infer.bench.random_weights import ensure_random_model as e; e('qwen3-8b')" > $OUT/w.log 2>&1
timeout 80 python3 -m agent_infer.cli bench latency --model $M8 --num-iters 3 --output-json $OUT/lat_tp1.json > $OUT/lat_tp1.log 2>&1; grep -E "decode tok/s|TTFT ms|iteration" $OUT/lat_tp1.log
timeout 90 python3 -m agent_infer.cli bench latency --model $M8 --tp 2 --num-iters 2 --output-json $OUT/lat_tp2.json > $OUT/lat_tp2.log 2>&1; grep -E "decode tok/s|TTFT ms" $OUT/lat_tp2.log
