"""KV memory budget and the one up-front allocation of the paged cache, for any mix of
cache layouts (kvcache/layouts.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from agent_infer.config import ConfigError
from agent_infer.kvcache.layouts import CacheLayout

# On a CPU the "free memory" is the machine's; take a modest share of it by default.
CPU_DEFAULT_SHARE = 0.25
CPU_DEFAULT_CAP = 1 << 30


@dataclass(frozen=True)
class KVBudget:
    num_blocks: int
    bytes_per_block: int
    source: str  # how the budget was decided, for the start-up log


def cpu_memory_available() -> int | None:
    """The kernel's estimate of the memory a new allocation can take without swapping
    (MemAvailable: free memory plus reclaimable caches); None where /proc/meminfo has none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def cpu_available_bytes() -> int:
    available = cpu_memory_available()
    return 8 << 30 if available is None else available


# Where the memory is unknown the up-front check passes and the allocation itself decides.
UNKNOWN_ROOM = 1 << 62


def kv_memory_available(device: torch.device) -> tuple[int, str]:
    """Bytes the KV pool can still take on `device`, and where they are (for messages)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        # What torch's caching allocator holds but no tensor uses is free to a new tensor
        # too: counting it keeps every budget that allocates today from being refused.
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return free + max(0, cached), f"free on {device}"
    available = cpu_memory_available()
    return (UNKNOWN_ROOM if available is None else available), "available on this host"


FIX_BUDGET = "lower --kv-cache-gib (kv_cache_bytes) or num_kv_blocks"


def kv_does_not_fit(
    source: str, num_blocks: int, block_size: int, bytes_per_block: int, room: int, where: str,
) -> ConfigError:
    """The error for a KV budget (`num_blocks`, decided by `source`) larger than the `room`
    bytes the device has: what was asked, and what would fit."""
    fit = room // bytes_per_block
    fit_gib = math.floor(fit * bytes_per_block / 2**30 * 100) / 100  # rounded down, so that it does fit
    return ConfigError(
        f"the KV cache does not fit: {source} asks for {num_blocks} blocks ({num_blocks * block_size} tokens, "
        f"{num_blocks * bytes_per_block / 2**30:.2f} GiB), but {room / 2**30:.2f} GiB is {where}, "
        f"room for {fit} blocks ({fit * block_size} tokens); ask for at most {fit_gib:.2f} GiB (--kv-cache-gib, "
        f"kv_cache_bytes) or {fit} blocks (num_kv_blocks)"
    )


def _is_out_of_memory(e: RuntimeError) -> bool:
    # CUDA raises torch.OutOfMemoryError; the CPU allocator a plain RuntimeError (or, in
    # some builds, OutOfMemoryError too) saying it "can't allocate memory".
    return isinstance(e, torch.OutOfMemoryError) or "can't allocate memory" in str(e)


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
            try:
                t = torch.zeros((len(layers), *layout.shape(num_blocks, block_size)), dtype=dtype, device=device)
            except RuntimeError as e:
                if not _is_out_of_memory(e):
                    raise
                self.tensors.clear()  # give back what the groups before this one took
                raise self._allocation_error(e) from None
            self.tensors.append(t)
            for j, i in enumerate(layers):
                views[i] = layout.view(t[j])
        self.views = [views[i] for i in range(len(self.layouts))]

    def _allocation_error(self, e: RuntimeError) -> ConfigError:
        """One line for an allocation the up-front check let through (memory it could not
        see, or taken meanwhile): the size asked for, the room left, the allocator's reason."""
        need = self.num_blocks * self.block_size * bytes_per_token(self.layouts, self.dtype)
        room, where = kv_memory_available(self.device)
        room_text = "" if room == UNKNOWN_ROOM else f" ({room / 2**30:.2f} GiB {where})"
        # The allocator's first two sentences say what failed; CUDA's go on for a paragraph.
        reason = ". ".join(str(e).split(". ")[:2]).splitlines()[0] if str(e) else type(e).__name__
        return ConfigError(
            f"cannot allocate the KV cache: {self.num_blocks} blocks ({self.num_blocks * self.block_size} tokens, "
            f"{need / 2**30:.2f} GiB) on {self.device}{room_text}: {reason}; {FIX_BUDGET}"
        )

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
            return KVBudget(num_blocks, bytes_per_block, f"num_kv_blocks={num_blocks}")
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
