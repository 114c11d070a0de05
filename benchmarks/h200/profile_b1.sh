#!/usr/bin/env bash
# Run on the lent 2 x H200 machine with .whl/ carried: per-kernel profiles (PDL off, so
# kernel times add up) of batch-1 decode at TP = 1 and at TP = 2 with the fused
# all-reduce + add + RMSNorm.
source benchmarks/h200/setup.sh
export AGENT_INFER_PDL=0
timeout 120 python3 -m agent_infer.cli bench latency --model $M8 --num-iters 1 --profile $OUT/p1 --output-json $OUT/prof_tp1.json > $OUT/prof_tp1.log 2>&1
grep -E "decode tok/s" $OUT/prof_tp1.log; grep -A17 "^profile" $OUT/prof_tp1.log | cut -c1-150
timeout 150 python3 -m agent_infer.cli bench latency --model $M8 --tp 2 --all-reduce symm_mem_fused --num-iters 1 --profile $OUT/p2 --output-json $OUT/prof_tp2.json > $OUT/prof_tp2.log 2>&1
grep -E "decode tok/s" $OUT/prof_tp2.log; grep -A17 "^profile" $OUT/prof_tp2.log | cut -c1-150
rm -rf $OUT/p1 $OUT/p2
