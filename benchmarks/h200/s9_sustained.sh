#!/usr/bin/env bash
# Ninth session: sustained bf16 GEMM rate (clock, power) over 8 s at M = 8,192 (kind
# nvidia-h200, .whl carried; ~1 min).
source benchmarks/h200/setup.sh
timeout 60 python3 benchmarks/gemm_sustained.py --seconds 8 2>&1 | tee $OUT/sustained.txt
