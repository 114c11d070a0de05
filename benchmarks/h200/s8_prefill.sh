#!/usr/bin/env bash
# Eighth session (kind nvidia-h200, .whl/ carried, COMMIT=<sha> literally): where the
# throughput workload's prefill goes, now that the prefill trace computes its prompts (the
# first run of next_s8.sh traced prefix-cache hits); then the workload at a 16,384-token
# step budget and with mixed batches, each a fresh process.
source benchmarks/h200/setup.sh
AGENT_INFER_PDL=0 timeout 300 python3 -m agent_infer.cli bench throughput --model $M8 --profile /tmp/pt \
  --output-json $OUT/throughput_profile.json > /tmp/thr.log 2>&1
echo "rc $?"; grep -E "output tok/s" /tmp/thr.log; grep -A17 "^profile: 10 steps from the start" /tmp/thr.log | cut -c1-150
for V in "--max-num-batched-tokens 16384" "--mixed-batches"; do
  N=$(echo $V | tr -d ' -' | cut -c1-20)
  timeout 200 python3 -m agent_infer.cli bench throughput --model $M8 $V --output-json $OUT/thr_$N.json > /tmp/thr_$N.log 2>&1
  echo "$V rc $?: $(grep -E 'output tok/s' /tmp/thr_$N.log)"
  grep -A9 "^where the wall time went" /tmp/thr_$N.log
done
