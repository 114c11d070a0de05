# Sourced by the benchmarks/h200 scripts, from the repository root on the GPU machine with
# .whl/ carried: the environment every process there needs, the carried wheels, and the
# Qwen3-8B-shape random checkpoint in $M8 (written on the machine once, ~60 s).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export AGENT_INFER_CACHE=/tmp/aic AGENT_INFER_GIT_COMMIT=${COMMIT:-unknown}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
M8=/tmp/aic/random/qwen3-8b
[ -d $M8 ] || timeout 150 python3 -c "from agent_infer.bench.random_weights import ensure_random_model as e; e('qwen3-8b')" > /tmp/w.log 2>&1
