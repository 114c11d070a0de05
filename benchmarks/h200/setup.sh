# Sourced by the benchmarks/h200 scripts, from the repository root on the GPU machine with
# .whl/ carried: the environment every process there needs, the carried wheels, and the
# Qwen3-8B-shape random checkpoint in $M8 (written on the machine once, ~60 s; not with NO_M8=1).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export AGENT_INFER_CACHE=/tmp/aic AGENT_INFER_GIT_COMMIT=${COMMIT:-unknown}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
M8=/tmp/aic/random/qwen3-8b
[ -n "${NO_M8:-}" ] || [ -d $M8 ] || timeout 150 python3 -c "from agent_infer.bench.random_weights import ensure_random_model as e; e('qwen3-8b')" > /tmp/w.log 2>&1

# Batch-1 latency A/B of the tree in .carry_ab/base.tar (git archive of the base) against
# this one, alternating, each a fresh process, the base first in odd rounds and last in
# even ones: ab_latency "<TP values>" [rounds, default 1]
ab_latency() {
  mkdir -p /tmp/base && tar -xf .carry_ab/base.tar -C /tmp/base
  local TP V T R
  for TP in $1; do
    for R in $(seq ${2:-1}); do
      for V in $( [ $((R % 2)) = 1 ] && echo base head || echo head base ); do
        if [ $V = base ]; then T=/tmp/base; else T=$PWD; fi
        (cd $T && PYTHONPATH=/tmp/site:$T timeout 120 python3 -m agent_infer.cli -v bench latency --model $M8 --tp $TP \
          --num-iters 3 --output-json $OUT/lat_tp${TP}_$V.json > $OUT/lat_tp${TP}_$V.log 2>&1)
        echo "tp$TP $V: $(grep -E 'decode tok/s' $OUT/lat_tp${TP}_$V.log | head -1)"
      done
    done
  done
}

# Throughput-workload A/B of the same two trees, alternating, the base first in odd rounds
# and last in even ones (the first run of a call has run slowest): ab_throughput [rounds, default 1]
ab_throughput() {
  mkdir -p /tmp/base && tar -xf .carry_ab/base.tar -C /tmp/base
  local V T R
  for R in $(seq ${1:-1}); do
    for V in $( [ $((R % 2)) = 1 ] && echo base head || echo head base ); do
      if [ $V = base ]; then T=/tmp/base; else T=$PWD; fi
      (cd $T && PYTHONPATH=/tmp/site:$T timeout 150 python3 -m agent_infer.cli bench throughput --model $M8 \
        --output-json $OUT/thr_${V}_$R.json > /tmp/thr_${V}_$R.log 2>&1)
      echo "throughput $V round $R: $(grep -E 'output tok/s' /tmp/thr_${V}_$R.log | head -1)"
    done
  done
}
