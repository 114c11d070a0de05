"""Which all-reduce the row-parallel layers use, chosen once at start-up on every rank."""

from __future__ import annotations

import logging
from dataclasses import replace

import torch
import torch.distributed as dist

from agent_infer.config import ConfigError
from agent_infer.distributed.state import ParallelState
from agent_infer.distributed.symm_mem import FUSED_MAX_BYTES, build_all_reduce, build_all_reduce_norm

log = logging.getLogger(__name__)


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
    group = dist.group.WORLD if tp.group is None else tp.group  # symmetric memory needs its name
    impl = build_all_reduce(group, device, dtype)
    if impl is None and mode in ("symm_mem", "symm_mem_fused"):
        raise ConfigError(f"--all-reduce {mode} was asked for but symmetric memory does not work here")
    # Collective: every rank agrees on `impl` (build_all_reduce's check), so all call it.
    norm_impl = build_all_reduce_norm(group, device, dtype) if impl is not None and mode != "symm_mem" else None
    if fused and norm_impl is None:
        raise ConfigError("--all-reduce symm_mem_fused was asked for but the fused kernel does not work here")
    if tp.is_first:
        log.info("all-reduce: %s%s",
                 "symmetric memory (one-shot / two-shot), NCCL above 8 MiB" if impl else "NCCL",
                 f"; fused with the residual add + RMSNorm up to {FUSED_MAX_BYTES >> 10} KiB" if norm_impl else "")
    if impl is None:
        return tp
    return replace(tp, all_reduce_impl=impl, all_reduce_norm_impl=norm_impl)
