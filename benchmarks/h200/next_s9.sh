#!/usr/bin/env bash
# Ninth session, first call (kind nvidia-h200, .whl carried; ~3 min): decode attention by
# split count over the throughput workload's falling batch, and with the rows longest
# first; then the 36 layers' GEMMs in one graph by batch size against their floor (cuBLAS,
# and up to 64 rows the Triton skinny GEMM).
source benchmarks/h200/setup.sh
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv
timeout 420 python3 benchmarks/throughput_kernels.py --only splits,chain 2>&1 | tee $OUT/splits_chain.txt | tail -20
