#!/usr/bin/env bash
# Ninth session: the Triton tiled GEMM with TMA loads (tensor descriptors), with and
# without warp specialisation, against cuBLAS at decode batches of 128 and 256 (kind
# nvidia-h200, .whl carried; ~4 min).
source benchmarks/h200/setup.sh
timeout 330 python3 benchmarks/decode_gemm.py --tma --sizes 128,256 2>&1 | grep -v Warning | tee $OUT/tma_sweep.txt | cut -c1-220 | tail -40
