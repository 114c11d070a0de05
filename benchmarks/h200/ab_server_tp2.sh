#!/usr/bin/env bash
# Run on the lent 2 x H200 machine through the device tool, with .whl/ carried plus three
# ignored folders prepared here: .carry_old (`git archive b5d4bff agent_infer`), .carry_nofuse
# (this tree with ResidualStream.start forced unfused) and .carry_tok (SmolLM2's tokenizer
# files, so the server can stream text for the random checkpoint).
# 1. Batch-1 A/B on one machine: before this session, this tree, this tree without folding
#    the residual into the GEMVs. 2. Server at concurrency 1/8/64 against offline at the
#    same batch. 3. TP = 2 batch-1 latency, symmetric-memory all-reduce and NCCL.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export AGENT_INFER_CACHE=/tmp/aic AGENT_INFER_GIT_COMMIT=${COMMIT:-unknown}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
M8=/tmp/aic/random/qwen3-8b
[ -d $M8 ] || PYTHONPATH=$PWD timeout 150 python3 -c "from agent_infer.bench.random_weights import ensure_random_model as e; e('qwen3-8b')" > $OUT/w.log 2>&1
cp .carry_tok/* $M8/
for V in old nofuse head; do
  if [ $V = head ]; then T=$PWD; else T=$PWD/.carry_$V; fi
  (cd $T && PYTHONPATH=/tmp/site:$T timeout 100 python3 -m agent_infer.cli bench latency --model $M8 --num-iters 3 --output-json $OUT/ab_$V.json > $OUT/ab_$V.log 2>&1)
  echo "$V: $(grep -E 'decode tok/s' $OUT/ab_$V.log | head -1)"; grep -E "TTFT ms" $OUT/ab_$V.log | head -1
done
export PYTHONPATH=/tmp/site:$PWD
python3 -m agent_infer.cli serve --model $M8 --port 8011 --max-num-seqs 64 > $OUT/server.log 2>&1 & SP=$!
for i in $(seq 150); do curl -sf localhost:8011/health >/dev/null && break; sleep 1; done
for C in 1 8 64; do N=$((C*4)); [ $C = 1 ] && N=4
  echo "c=$C"; timeout 80 python3 -m agent_infer.cli bench serve --base-url http://localhost:8011/v1 --max-concurrency $C --num-prompts $N --random-input-len 256 --random-output-len 256 --temperature 0 --result-json $OUT/serve_c$C.json 2>&1 | grep -E "Successful|Output token throughput|TTFT|TPOT|ITL|E2E|error"
done
kill $SP; wait $SP 2>/dev/null
timeout 100 python3 -m agent_infer.cli bench throughput --model $M8 --num-seqs 256 --min-len 256 --max-len 256 --max-num-seqs 64 --temperature 0 --output-json $OUT/offline_c64.json 2>&1 | grep -E "output tok/s|wall"
for AR in auto nccl; do
  timeout 110 python3 -m agent_infer.cli -v bench latency --model $M8 --tp 2 --all-reduce $AR --num-iters 2 --profile $OUT/p_$AR --output-json $OUT/lat_tp2_$AR.json > $OUT/lat_tp2_$AR.log 2>&1
  grep -E "all-reduce:" $OUT/lat_tp2_$AR.log | head -1; grep -A8 "^profile" $OUT/lat_tp2_$AR.log | head -9; grep -E "decode tok/s|TTFT|peak memory" $OUT/lat_tp2_$AR.log
done
