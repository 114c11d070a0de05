#!/usr/bin/env bash
# Ninth session: a plain Triton tiled GEMM (benchmarks/decode_gemm.py) swept over tiles and
# K splits for each Qwen3-8B projection at batches 96-256, against cuBLAS and cuBLASLt in
# the same 36-weight graphs (kind nvidia-h200, .whl carried; ~2 min). The recorded run
# (results/s9_matmul_sweep.txt) had the same kernel in the package as
# agent_infer/kernels/triton/matmul.py, swept from throughput_kernels.py; it lost to
# cuBLAS at every shape, so it moved here.
source benchmarks/h200/setup.sh
timeout 540 python3 benchmarks/decode_gemm.py 2>&1 | grep -v Warning | tee $OUT/mm_sweep.txt | tail -30
