#!/usr/bin/env bash
# Branch wip/gemv-prefetch, not yet run on a GPU. Run on the lent 2 x H200 machine (kind
# nvidia-h200-x2) from this branch's root with .whl/ and .carry_ab/ carried, where
#   git archive -o .carry_ab/base.tar main     # the tree to compare against
# A/B of the batch-1 GEMV loading two weight tiles before its PDL wait instead of one:
# the GEMV kernel tests on this tree, then batch-1 latency at TP = 1 and TP = 2 for the
# base and this tree, alternating, each a fresh process (~6 min).
source benchmarks/h200/setup.sh
timeout 120 python3 -m pytest -q -x tests/gpu/test_kernels.py -k "gemv_m1" > $OUT/kernels.log 2>&1; tail -1 $OUT/kernels.log
ab_latency "1 2"
