#!/usr/bin/env bash
# Ninth session, closing call (kind nvidia-h200, carry .whl and .carry_ab = git archive
# 83f1a3c; COMMIT=<sha> literally; ~7 min): the committed tree against the session's base
# on the throughput workload (two rounds, alternating), a PDL-off profile of the committed
# tree (its decode trace at batch 256, its prefill trace), and batch 1 at TP = 1 for both.
source benchmarks/h200/setup.sh
ab_throughput 2
AGENT_INFER_PDL=0 timeout 200 python3 -m agent_infer.cli bench throughput --model $M8 --profile /tmp/pt \
  --output-json $OUT/throughput_profile_nopdl.json > /tmp/thr.log 2>&1
echo "profile rc $?"; grep -A17 "^profile:" /tmp/thr.log | cut -c1-150
ab_latency 1 1
