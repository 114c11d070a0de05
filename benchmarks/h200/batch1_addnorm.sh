#!/usr/bin/env bash
# Run on the lent H200 machine through the device tool, with .whl/ and .carry_ab/ carried
# (.carry_ab/base.tar: `git archive` of the commit to compare against): the GPU kernel and
# engine tests of this tree, then batch-1 latency of the base and of this tree (the
# latter with transformers in the same process), each a fresh process.
source benchmarks/h200/setup.sh
timeout 240 python3 -m pytest -q -x tests/gpu/test_kernels.py -k "gemv_m1 or argmax or fill or cuda_graph" > $OUT/kernels.log 2>&1; tail -2 $OUT/kernels.log
timeout 200 python3 -m pytest -q -x tests/gpu/test_engine_gpu.py > $OUT/engine.log 2>&1; tail -2 $OUT/engine.log
mkdir -p /tmp/base && tar -xf .carry_ab/base.tar -C /tmp/base
(cd /tmp/base && PYTHONPATH=/tmp/site:/tmp/base AGENT_INFER_GIT_COMMIT=${BASE:-base} timeout 100 python3 -m agent_infer.cli bench latency --model $M8 --num-iters 3 --output-json $OUT/lat_base.json > $OUT/lat_base.log 2>&1); grep -E "decode tok/s|TTFT ms" $OUT/lat_base.log
timeout 150 python3 -m agent_infer.cli bench latency --model $M8 --num-iters 3 --compare-hf --output-json $OUT/lat_new.json > $OUT/lat_new.log 2>&1; grep -E "decode tok/s|TTFT ms|decode step" $OUT/lat_new.log
