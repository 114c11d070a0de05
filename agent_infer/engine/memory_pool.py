"""KV memory budget and the one up-front allocation of the paged cache."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from agent_infer.engine.kv_specs import KVSpec

log = logging.getLogger(__name__)

# On a CPU the "free memory" is the machine's; take a modest share of it by default.
CPU_DEFAULT_SHARE = 0.25
CPU_DEFAULT_CAP = 1 << 30


@dataclass(frozen=True)
class KVBudget:
    num_blocks: int
    bytes_per_block: int
    source: str  # how the budget was decided, for the start-up log

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block


def cpu_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


class KVMemoryPool:
    """Decides how many blocks fit, then allocates them once (graph-safe: never grown).

    Dense layout: one tensor [num_layers, 2, num_blocks, block_size, kv_heads, head_dim];
    layer i reads K at [i, 0] and V at [i, 1]. MLA layout: [num_layers, num_blocks,
    block_size, 1, latent_dim].
    """

    def __init__(self, spec: KVSpec, block_size: int, num_blocks: int, device: torch.device):
        self.spec = spec
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = device
        if spec.num_kv_tensors == 2:
            shape = (spec.num_layers, 2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        else:
            shape = (spec.num_layers, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        # Zeros, not empty: unused slots are masked out, but 0 * NaN would still poison
        # a weighted sum of garbage values.
        self.cache = torch.zeros(shape, dtype=spec.dtype, device=device)

    def layer(self, i: int) -> torch.Tensor:
        return self.cache[i]

    @property
    def nbytes(self) -> int:
        return self.cache.numel() * self.cache.element_size()

    @staticmethod
    def estimate_num_blocks(
        spec: KVSpec,
        block_size: int,
        device: torch.device,
        gpu_memory_utilization: float,
        kv_cache_bytes: int | None = None,
        num_blocks: int | None = None,
        peak_runtime_bytes: int = 0,
    ) -> KVBudget:
        """Blocks that fit the budget: an explicit block count, an explicit byte budget,
        or (GPU) total memory x utilisation minus what weights, activations and other
        processes already take, or (CPU) a share of the available memory."""
        per_block = spec.bytes_per_block(block_size)
        if num_blocks is not None:
            return KVBudget(num_blocks, per_block, "num_kv_blocks")
        if kv_cache_bytes is not None:
            return KVBudget(max(0, kv_cache_bytes // per_block), per_block, f"kv_cache_bytes={kv_cache_bytes}")
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            torch_reserved = torch.cuda.memory_reserved(device)
            held = torch.cuda.memory_allocated(device)  # the weights, mostly
            non_torch = max(0, (total - free) - torch_reserved)
            budget = int(total * gpu_memory_utilization) - held - peak_runtime_bytes - non_torch
            source = (
                f"{gpu_memory_utilization:.2f} x {total / 2**30:.1f} GiB - weights {held / 2**30:.2f} GiB"
                f" - peak activations {peak_runtime_bytes / 2**30:.2f} GiB - other {non_torch / 2**30:.2f} GiB"
            )
        else:
            budget = min(CPU_DEFAULT_CAP, int(cpu_available_bytes() * CPU_DEFAULT_SHARE))
            source = f"CPU default ({budget / 2**30:.2f} GiB)"
        return KVBudget(max(0, budget // per_block), per_block, source)
