"""KV memory budget and the one up-front allocation of the paged cache, for any mix of
cache layouts (kvcache/layouts.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agent_infer.kvcache.layouts import CacheLayout

# On a CPU the "free memory" is the machine's; take a modest share of it by default.
CPU_DEFAULT_SHARE = 0.25
CPU_DEFAULT_CAP = 1 << 30


@dataclass(frozen=True)
class KVBudget:
    num_blocks: int
    bytes_per_block: int
    source: str  # how the budget was decided, for the start-up log


def cpu_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def bytes_per_token(layouts: list[CacheLayout], dtype: torch.dtype) -> int:
    """Cache bytes one token costs on this rank, over every layer."""
    elem = torch.empty((), dtype=dtype).element_size()
    return sum(layout.values_per_token for layout in layouts) * elem


class KVMemoryPool:
    """Decides how many blocks fit, then allocates them once (graph-safe: never grown).

    Layers with the same layout share one tensor, [layers, *layout.shape(blocks, size)],
    and each layer gets its typed view of its slice (`views[i]`). Every layer has the
    same number of blocks: one block id means the same tokens in all of them.
    """

    def __init__(
        self, layouts: list[CacheLayout], block_size: int, num_blocks: int, dtype: torch.dtype, device: torch.device,
    ):
        self.layouts = list(layouts)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.dtype = dtype
        self.device = device
        groups: dict[CacheLayout, list[int]] = {}
        for i, layout in enumerate(self.layouts):
            groups.setdefault(layout, []).append(i)
        self.tensors: list[torch.Tensor] = []
        views: dict[int, object] = {}
        for layout, layers in groups.items():
            # Zeros, not empty: unused slots are masked out, but 0 * NaN would still poison
            # a weighted sum of garbage values.
            t = torch.zeros((len(layers), *layout.shape(num_blocks, block_size)), dtype=dtype, device=device)
            self.tensors.append(t)
            for j, i in enumerate(layers):
                views[i] = layout.view(t[j])
        self.views = [views[i] for i in range(len(self.layouts))]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    @staticmethod
    def estimate_num_blocks(
        bytes_per_block: int,
        device: torch.device,
        gpu_memory_utilization: float,
        kv_cache_bytes: int | None = None,
        num_blocks: int | None = None,
        peak_runtime_bytes: int = 0,
    ) -> KVBudget:
        """Blocks that fit the budget: an explicit block count, an explicit byte budget,
        or (GPU) total memory x utilisation minus what weights, activations and other
        processes already take, or (CPU) a share of the available memory."""
        if num_blocks is not None:
            return KVBudget(num_blocks, bytes_per_block, "num_kv_blocks")
        if kv_cache_bytes is not None:
            return KVBudget(max(0, kv_cache_bytes // bytes_per_block), bytes_per_block, f"kv_cache_bytes={kv_cache_bytes}")
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
        return KVBudget(max(0, budget // bytes_per_block), bytes_per_block, source)
