#!/usr/bin/env bash
# Run on the lent H200 machine through the device tool, from the repository root (second
# session of 2026-11-29, commit 4b40e51): kernel tests, then batch-1 latency with and
# without programmatic dependent launch. The GEMV chain figures came from
# `python3 benchmarks/gemv_chain.py` in a separate call. Figures: docs/PERFORMANCE.md.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export AGENT_INFER_CACHE=/tmp/aic AGENT_INFER_GIT_COMMIT=${COMMIT:-unknown} PYTHONPATH=$PWD
(timeout 150 python3 -c "from agent_infer.bench.random_weights import ensure_random_model as e; e('qwen3-8b')" > $OUT/w.log 2>&1) &
timeout 200 python3 -m pytest -q -x tests/gpu/test_kernels.py 2>&1 | tail -4
wait
timeout 150 python3 -m agent_infer.cli bench latency --random-weights qwen3-8b --num-iters 3 --profile $OUT/pl --output-json $OUT/lat.json > $OUT/lat.log 2>&1; grep -A16 "^profile" $OUT/lat.log | head -18; tail -8 $OUT/lat.log
AGENT_INFER_PDL=0 timeout 120 python3 -m agent_infer.cli bench latency --random-weights qwen3-8b --num-iters 3 --output-json $OUT/lat_nopdl.json > $OUT/lat_nopdl.log 2>&1; tail -6 $OUT/lat_nopdl.log
