#!/usr/bin/env bash
# Ninth session: the decode kernel tests (the new row order among them) and the engine GPU
# tests on this tree, then decode attention by row order at more batch sizes (kind
# nvidia-h200, .whl carried; ~5 min).
source benchmarks/h200/setup.sh
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels.py -k "decode" 2>&1 | tail -4 | tee $OUT/kernel_tests.txt
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_engine_gpu.py 2>&1 | tail -4 | tee $OUT/engine_tests.txt
timeout 150 python3 benchmarks/throughput_kernels.py --only splits 2>&1 | tee $OUT/orders.txt | grep -E "batch|order" | cut -c1-250
