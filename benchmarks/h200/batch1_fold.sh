#!/usr/bin/env bash
# Run on the lent H200 machine through the device tool, with .whl/ and .carry_nofuse (this
# tree with ResidualStream.start forced unfused) carried: the residual/decode kernel
# tests, batch-1 A/B (unfused vs folded, the folded run against transformers), the GPU
# engine tests on the tiny checkpoints (batched and alone against transformers), and the
# TP GPU tests.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export AGENT_INFER_CACHE=/tmp/aic AGENT_INFER_GIT_COMMIT=${COMMIT:-unknown}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
M8=/tmp/aic/random/qwen3-8b
[ -d $M8 ] || (timeout 150 python3 -c "from agent_infer.bench.random_weights import ensure_random_model as e; e('qwen3-8b')" > $OUT/w.log 2>&1) &
timeout 120 python3 -m pytest -q tests/gpu/test_kernels.py -k "gemv_m1 or decode" 2>&1 | tail -2
wait
(cd .carry_nofuse && PYTHONPATH=/tmp/site:$PWD timeout 100 python3 -m agent_infer.cli bench latency --model $M8 --num-iters 3 --output-json $OUT/ab_nofuse.json > $OUT/ab_nofuse.log 2>&1)
echo "nofuse: $(grep -E 'decode tok/s' $OUT/ab_nofuse.log | head -1)"
timeout 170 python3 -m agent_infer.cli bench latency --model $M8 --num-iters 3 --compare-hf --hf-iters 1 --output-json $OUT/lat.json > $OUT/lat.log 2>&1; tail -9 $OUT/lat.log | head -6
timeout 110 python3 -m pytest -q -s tests/gpu/test_engine_gpu.py -k "not default" 2>&1 | grep -E "passed|failed|matched|Error" | head -8
AGENT_INFER_TP_MODEL_DIR=$M8 timeout 150 python3 -m pytest -q -s tests/gpu/test_tp_gpu.py 2>&1 | grep -E "passed|failed|matched|chosen|allocated|Error" | head -8
