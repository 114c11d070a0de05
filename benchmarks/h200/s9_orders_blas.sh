#!/usr/bin/env bash
# Ninth session: decode attention by row order (as drawn, longest first, long/short
# alternating) at the rule's split count over the workload's batches, and cuBLAS against
# cuBLASLt for each projection at every captured decode batch and at prefill sizes
# (kind nvidia-h200, .whl carried; ~4 min).
source benchmarks/h200/setup.sh
timeout 540 python3 benchmarks/throughput_kernels.py --only splits,blas 2>&1 | grep -v Warning | tee $OUT/orders_blas.txt | tail -50
