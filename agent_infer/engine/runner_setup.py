"""Bring a ModelRunner up to serving state: load the model, size the KV pool, allocate it,
capture graphs. Rank 0 and every tensor-parallel worker run this same code, so all ranks
agree on the pool size (the smallest any rank can afford) and on the context length."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from agent_infer.config import ConfigError, EngineConfig, ModelConfig
from agent_infer.engine.memory_pool import KVMemoryPool
from agent_infer.engine.model_runner import ModelRunner
from agent_infer.tp_layers.distributed import ParallelState
from agent_infer.tp_layers.symm_mem import FUSED_MAX_BYTES, build_all_reduce, build_all_reduce_norm

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunnerPlan:
    num_blocks: int
    max_model_len: int


def resolve_max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    model_max = model_config.max_position_embeddings
    if config.max_model_len is None:
        return model_max
    if config.max_model_len > model_max:
        raise ConfigError(f"max_model_len {config.max_model_len} exceeds the model's max_position_embeddings {model_max}")
    return config.max_model_len


def check_tp_divisibility(model_config: ModelConfig, tp: int) -> None:
    """Fail before any process starts when the heads cannot be split tp ways."""
    if tp == 1:
        return
    heads, kv = model_config.num_heads, model_config.num_kv_heads
    works = [d for d in range(1, heads + 1) if heads % d == 0 and (kv % d == 0 or d % kv == 0)]
    if heads % tp or (tp <= kv and kv % tp) or (tp > kv and tp % kv):
        raise ConfigError(
            f"tensor-parallel size {tp} does not divide this model ({heads} attention heads, {kv} KV heads); "
            f"sizes that work: {works}"
        )


def setup_runner(
    config: EngineConfig, model_config: ModelConfig, device: torch.device, dtype: torch.dtype, tp: ParallelState
) -> tuple[ModelRunner, RunnerPlan]:
    max_model_len = resolve_max_model_len(config, model_config)
    tp = choose_all_reduce(tp, device, dtype, config.all_reduce)
    runner = ModelRunner(model_config, config, device, dtype, max_model_len, tp)
    peak = runner.profile_peak_memory(min(config.max_num_batched_tokens, max_model_len), config.max_num_seqs)
    budget = KVMemoryPool.estimate_num_blocks(
        runner.kv_spec(), config.block_size, device, config.gpu_memory_utilization,
        config.kv_cache_bytes, config.num_kv_blocks, peak,
    )
    num_blocks = _agree_min(budget.num_blocks, device, tp)
    if num_blocks < 1:
        raise ConfigError(f"no memory left for the KV cache ({budget.source}); use a smaller model or a larger budget")
    capacity = num_blocks * config.block_size
    if capacity < max_model_len:
        if config.max_model_len is not None:
            raise ConfigError(
                f"the KV cache holds {capacity} tokens ({num_blocks} blocks) but max_model_len is "
                f"{config.max_model_len}; lower max_model_len or give the cache more memory"
            )
        log.warning("KV cache holds %d tokens: max_model_len lowered from %d", capacity, max_model_len)
        max_model_len = capacity
        runner.max_model_len = capacity
    if tp.is_first:
        log.info(
            "KV cache: %d blocks x %d tokens = %d tokens, %.2f GiB per rank (%s)",
            num_blocks, config.block_size, capacity, num_blocks * budget.bytes_per_block / 2**30, budget.source,
        )
    runner.init_kv_cache(num_blocks)
    runner.capture_graphs()
    return runner, RunnerPlan(num_blocks, max_model_len)


def choose_all_reduce(tp: ParallelState, device: torch.device, dtype: torch.dtype, mode: str) -> ParallelState:
    """Pick the all-reduce once, on every rank alike, and say which. On GPUs `auto` takes
    symmetric memory and, where its start-up check passes, the fused all-reduce + residual
    add + RMSNorm; `symm_mem` is the plain symmetric-memory all-reduce, `symm_mem_fused`
    insists on the fusion. On CPU: gloo (the row-parallel layers then reduce, add and
    normalise in three steps, `all_reduce_add_rms_norm`'s fallback)."""
    if tp.world_size == 1:
        return tp
    fused = mode == "symm_mem_fused"
    if device.type != "cuda" or mode == "nccl":
        if tp.is_first:
            log.info("all-reduce: %s", "gloo" if device.type != "cuda" else "NCCL")
        return tp
    impl = build_all_reduce(tp.group, device, dtype)
    if impl is None and mode in ("symm_mem", "symm_mem_fused"):
        raise ConfigError(f"--all-reduce {mode} was asked for but symmetric memory does not work here")
    # Collective: every rank agrees on `impl` (build_all_reduce's check), so all call it.
    norm_impl = build_all_reduce_norm(tp.group, device, dtype) if impl is not None and mode != "symm_mem" else None
    if fused and norm_impl is None:
        raise ConfigError("--all-reduce symm_mem_fused was asked for but the fused kernel does not work here")
    if tp.is_first:
        log.info("all-reduce: %s%s",
                 "symmetric memory (one-shot / two-shot), NCCL above 8 MiB" if impl else "NCCL",
                 f"; fused with the residual add + RMSNorm up to {FUSED_MAX_BYTES >> 10} KiB" if norm_impl else "")
    if impl is None:
        return tp
    return replace(tp, all_reduce_impl=impl, all_reduce_norm_impl=norm_impl)


def _agree_min(value: int, device: torch.device, tp: ParallelState) -> int:
    if tp.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=tp.group)
    return int(t.item())
