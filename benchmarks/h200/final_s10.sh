#!/usr/bin/env bash
# Tenth session, closing call (kind nvidia-h200, carry .whl; COMMIT=<sha> literally;
# ~6 min): every single-GPU figure of issue 3 again on the committed tree: batch 1 with
# transformers in the same run, batch 1 eager, the throughput workload for the Qwen3-8B
# and Qwen3-0.6B shapes.
source benchmarks/h200/setup.sh
bench() {
  local name=$1; shift
  timeout 240 python3 -m agent_infer.cli bench "$@" --output-json $OUT/s10_$name.json > /tmp/$name.log 2>&1
  echo "== $name: rc $?"; grep -iE "tok/s|ttft|transformers|peak|x faster|ratio" /tmp/$name.log | head -10 | cut -c1-200
}
bench lat_hf latency --model $M8 --num-iters 3 --compare-hf
bench lat_eager latency --model $M8 --enforce-eager --num-warmup 1 --num-iters 1 --output-len 64
bench thr_8b throughput --model $M8
bench thr_06b throughput --random-weights qwen3-0.6b
