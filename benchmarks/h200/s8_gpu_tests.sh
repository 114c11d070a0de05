#!/usr/bin/env bash
# Eighth session (kind nvidia-h200, .whl carried): the GPU test files touched by this
# session's kernels: every kernel test, the compile checks, and the engine's GPU tests
# (transformers closeness, graphs against eager).
source benchmarks/h200/setup.sh
timeout 280 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels.py tests/test_kernel_compile.py \
  > $OUT/kernel_tests.txt 2>&1; echo "kernel tests rc $?: $(tail -1 $OUT/kernel_tests.txt)"
timeout 280 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_engine_gpu.py > $OUT/engine_tests.txt 2>&1
echo "engine tests rc $?: $(tail -1 $OUT/engine_tests.txt)"
grep -E "FAILED|Error" $OUT/kernel_tests.txt $OUT/engine_tests.txt | head -20
