#!/usr/bin/env bash
# Tenth session: cuBLAS's pick against TunableOp's fastest GEMM algorithm at decode batches
# (benchmarks/throughput_kernels.py --only tunable; kind nvidia-h200, .whl carried; ~4 min).
NO_M8=1 source benchmarks/h200/setup.sh
PYTORCH_TUNABLEOP_VERBOSE=1 timeout 450 python3 benchmarks/throughput_kernels.py --only tunable \
  --tunable-rows ${ROWS:-32,64,96,128,160,192,224,256} > /tmp/tunable.log 2>&1
echo "rc $?"
grep -E "^NVIDIA|==|M=|picked" /tmp/tunable.log | cut -c1-400 | tee $OUT/tunable.txt
grep -ciE "cublaslt" /tmp/tunable.log; grep -iE "solution|candidate|Gemm_" /tmp/tunable.log | head -30 | cut -c1-300
