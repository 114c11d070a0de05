#!/usr/bin/env bash
# For the next session (kind nvidia-h200, .whl/ carried, COMMIT=<sha> given literally: the
# device's copy of .git is stale): where the throughput workload's prefill time goes.
# The prefill takes 3.6 s against a 2.6 s floor (GEMMs at 790 TFLOP/s) and was never
# profiled. Throughput with --profile: 10 decode steps at batch 256 and the first 10
# steps of a fresh batch of 256 prompts of 562 tokens (prefill, 8192 tokens a step), PDL
# off so kernel times add up (~3 min).
source benchmarks/h200/setup.sh
AGENT_INFER_PDL=0 timeout 300 python3 -m agent_infer.cli bench throughput --model $M8 --profile /tmp/pt \
  --output-json $OUT/throughput_profile.json > /tmp/thr.log 2>&1
echo "rc $?"; grep -E "output tok/s|^profile" /tmp/thr.log; grep -A17 "^profile: 10 steps from the start" /tmp/thr.log | cut -c1-150
