#!/usr/bin/env bash
# Branch wip/gemv-prefetch, not yet run on a GPU. Run on the lent 2 x H200 machine (kind
# nvidia-h200-x2) from this branch's root with .whl/ and .carry_ab/ carried, where
#   git archive -o .carry_ab/base.tar main     # the tree to compare against
# A/B of the batch-1 GEMV loading two weight tiles before its PDL wait instead of one:
# the GEMV kernel tests on this tree, then batch-1 latency at TP = 1 and TP = 2 for the
# base and this tree, alternating, each a fresh process (~6 min).
source benchmarks/h200/setup.sh
timeout 120 python3 -m pytest -q -x tests/gpu/test_kernels.py -k "gemv_m1" > $OUT/kernels.log 2>&1; tail -1 $OUT/kernels.log
mkdir -p /tmp/base && tar -xf .carry_ab/base.tar -C /tmp/base
for TP in 1 2; do
  for V in base head; do
    if [ $V = base ]; then T=/tmp/base; else T=$PWD; fi
    (cd $T && PYTHONPATH=/tmp/site:$T timeout 120 python3 -m agent_infer.cli bench latency --model $M8 --tp $TP \
      --num-iters 3 --output-json $OUT/lat_tp${TP}_$V.json > $OUT/lat_tp${TP}_$V.log 2>&1)
    echo "tp$TP $V: $(grep -E 'decode tok/s' $OUT/lat_tp${TP}_$V.log | head -1)"
  done
done
