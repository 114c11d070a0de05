"""Bring a ModelRunner up to serving state: load the model, size the KV pool, allocate it,
capture graphs. Rank 0 and every tensor-parallel worker run this same code, so all ranks
agree on the pool size (the smallest any rank can afford) and on the context length."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from agent_infer.config import ConfigError, EngineConfig, ModelConfig
from agent_infer.distributed.all_reduce import choose_all_reduce
from agent_infer.distributed.state import ParallelState
from agent_infer.engine.model_runner import ModelRunner
from agent_infer.kvcache.calibration import calibration_ids
from agent_infer.kvcache.pool import KVMemoryPool, kv_does_not_fit, kv_memory_available
from agent_infer.loader.tokenizer import load_tokenizer_if_any, tokenizer_path

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


def setup_runner(
    config: EngineConfig, model_config: ModelConfig, device: torch.device, dtype: torch.dtype, tp: ParallelState,
    tokenizer=None,
) -> tuple[ModelRunner, RunnerPlan]:
    """`tokenizer`: the engine's, where this rank has loaded it (rank 0); a worker loads its
    own only if a start-up step needs it (--calculate-kv-scales)."""
    max_model_len = resolve_max_model_len(config, model_config)
    tp = replace(choose_all_reduce(tp, device, dtype, config.all_reduce), moe_parallel=config.moe_parallel)
    runner = ModelRunner(model_config, config, device, dtype, max_model_len, tp)
    peak = runner.profile_peak_memory(min(config.max_num_batched_tokens, max_model_len), config.max_decode_rows)
    budget = KVMemoryPool.estimate_num_blocks(
        runner.cache_bytes_per_token() * config.block_size, device, config.gpu_memory_utilization,
        config.kv_cache_bytes, config.num_kv_blocks, peak,
    )
    # Checked before allocating: a budget beyond the machine's memory would otherwise fail
    # deep in the allocator, or on a CPU be granted lazily and swap or get the process
    # killed while the zeros are written. Every rank takes the same decision, on the
    # smallest room any rank has.
    room, where = kv_memory_available(device)
    num_blocks, room = _agree_min([budget.num_blocks, room], device, tp)
    if tp.world_size > 1:
        where = f"free on the rank with the least (of {tp.world_size})"
    if num_blocks < 1:
        raise ConfigError(f"no memory left for the KV cache ({budget.source}); use a smaller model or a larger budget")
    if num_blocks * budget.bytes_per_block > room:
        raise kv_does_not_fit(budget.source, num_blocks, config.block_size, budget.bytes_per_block, room, where)
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
    if config.calculate_kv_scales:
        if tokenizer is None:
            tokenizer = load_tokenizer_if_any(tokenizer_path(config.tokenizer, config.model))
        _calibrate_kv_scales(runner, tokenizer, model_config, min(config.max_num_batched_tokens, max_model_len), tp)
    runner.init_kv_cache(num_blocks)
    runner.capture_graphs()
    return runner, RunnerPlan(num_blocks, max_model_len)


def _calibrate_kv_scales(runner: ModelRunner, tokenizer, model_config: ModelConfig, limit: int,
                         tp: ParallelState) -> None:
    """--calculate-kv-scales (kvcache/calibration.py): every rank runs the calibration
    prefill (its collectives need them all) and the ranks agree on each layer's maximum."""
    ids = calibration_ids(tokenizer, model_config.vocab_size, limit)
    amax = runner.measure_kv_amax(ids)
    if tp.world_size > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=tp.group)
    runner.use_kv_scales(amax)
    if tp.is_first:
        log.info("KV-cache scales computed for %d layers from a %d-token calibration prefill", len(amax), len(ids))


def _agree_min(values: list[int], device: torch.device, tp: ParallelState) -> list[int]:
    """Each value's minimum over the ranks."""
    if tp.world_size == 1:
        return values
    t = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=tp.group)
    return [int(v) for v in t.tolist()]
