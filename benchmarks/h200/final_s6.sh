#!/usr/bin/env bash
# Run on the lent 2 x H200 machine with .whl/ and .carry_tok/ carried: the sixth
# session's closing figures of the committed tree (COMMIT=<sha>): TP = 2 and TP = 1
# batch-1 latency, the TP = 2 token checks, per-kernel profiles of TP = 2 decode with the
# fused all-reduce and with NCCL (PDL off, so kernel times add up), the server with
# --tp 2 at concurrency 8, and last the 2-GPU fused all-reduce kernel test (~9 min).
source benchmarks/h200/setup.sh
lat() {  # name, args...
  local name=$1; shift
  timeout 110 python3 -m agent_infer.cli -v bench latency --model $M8 --num-iters 3 "$@" --output-json $OUT/$name.json > /tmp/$name.log 2>&1
  echo "$name: $(grep -E 'decode tok/s' /tmp/$name.log | head -1 | cut -c1-60) $(grep -o 'all-reduce: [^|]*' /tmp/$name.log | head -1 | cut -c1-60)"
}
lat tp2_latency --tp 2
lat tp1_latency
AGENT_INFER_TP_MODEL_DIR=$M8 timeout 150 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_tp_gpu.py -k fused > $OUT/parity.txt 2>&1
echo "parity rc $?: $(grep -E 'matched|alone|passed|failed' $OUT/parity.txt | tr '\n' ' ' | cut -c1-220)"
for AR in auto nccl; do
  AGENT_INFER_PDL=0 timeout 110 python3 -m agent_infer.cli -v bench latency --model $M8 --tp 2 --all-reduce $AR --num-iters 1 \
    --profile /tmp/prof_$AR --output-json $OUT/profile_tp2_$AR.json > /tmp/prof_$AR.log 2>&1
  echo "== profile $AR (PDL off)"; grep -A9 "^profile" /tmp/prof_$AR.log | cut -c1-120
done
cp .carry_tok/* $M8/
python3 -m agent_infer.cli serve --model $M8 --port 8011 --tp 2 --max-num-seqs 16 > /tmp/server_tp2.log 2>&1 & SP=$!
for i in $(seq 150); do curl -sf localhost:8011/health >/dev/null && break; sleep 1; done
curl -sN localhost:8011/v1/completions -H 'content-type: application/json' -d '{"model":"qwen3-8b","prompt":"Hello","max_tokens":8,"stream":true}' | head -c 300; echo
timeout 80 python3 -m agent_infer.cli bench serve --base-url http://localhost:8011/v1 --max-concurrency 8 --num-prompts 32 --random-input-len 256 --random-output-len 256 --temperature 0 --result-json $OUT/serve_tp2_c8.json 2>&1 | grep -E "Successful|Output token throughput|TPOT|error"
kill $SP; wait $SP 2>/dev/null
timeout 100 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_fused_allreduce_gpu.py > $OUT/fused_test.txt 2>&1
echo "fused kernel test rc $?: $(grep -E 'us per norm|passed|failed' $OUT/fused_test.txt | tr '\n' ' ')"
