#!/usr/bin/env bash
# Ninth session: a layer's four GEMMs per prefill token by step size, 4,096-16,384 rows
# (kind nvidia-h200, .whl carried; ~2 min).
source benchmarks/h200/setup.sh
# First call: 4,096-16,384 by 512 (results/s9_prefill_rows.txt, first block).
[ -n "$FINE_ONLY" ] || timeout 240 python3 benchmarks/throughput_kernels.py --only prefill_rows 2>&1 | tee $OUT/prefill_rows.txt | tail -30
# Then finer, around the two step sizes of interest (the 4,096 and 8,192 budgets).
for R in 3072:4353:64 7424:8449:64; do
  timeout 120 python3 benchmarks/throughput_kernels.py --only prefill_rows --prefill-rows $R 2>&1 | tee -a $OUT/prefill_rows.txt | grep "M=" | cut -c1-80
done
