#!/usr/bin/env bash
# Ninth session: the throughput workload, base (.carry_ab/base.tar = git archive 83f1a3c)
# against this tree (decode attention takes the longest contexts first past one wave),
# alternating, two rounds; then batch 1 at TP = 1 for both (kind nvidia-h200, carry .whl
# and .carry_ab; ~5 min).
source benchmarks/h200/setup.sh
ab_throughput 2
ab_latency 1 1
