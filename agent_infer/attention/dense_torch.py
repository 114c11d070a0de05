"""Dense paged attention in plain PyTorch (any device): the reference the Triton backend
is tested against, and the CPU path. Reads the cache layout of `kvcache.DenseKVLayout`."""

from __future__ import annotations

import torch

from agent_infer.attention.backend import AttentionBackend
from agent_infer.attention.metadata import AttentionMetadata
from agent_infer.config import ConfigError
from agent_infer.kernels import reference
from agent_infer.kvcache.layouts import DenseKVCache


class DenseTorchBackend(AttentionBackend):
    name = "torch"
    reads_decode_lens_on_host = True

    def __init__(self, layer, max_batch: int, device: torch.device, batch_invariant: bool = False):
        super().__init__(layer, max_batch, device, batch_invariant)
        if batch_invariant and device.type == "cuda":
            # Invariant rows gather exactly their own context, which needs the lengths on
            # the host; a captured decode graph's are placeholders.
            raise ConfigError("batch_invariant on a GPU needs the triton attention backend: the torch one's graph "
                              "steps attend over padded block tables, whose width depends on the step")

    def attend(self, q: torch.Tensor, cache: DenseKVCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q [T, H, D] -> [T, H, D] over the cache, which already holds this step's K/V."""
        if meta.is_prefill:
            return reference.prefill_attention(
                q, cache.k, cache.v, meta.block_tables, meta.query_lens_host, meta.context_lens_host, scale,
                cache.k_scale, cache.v_scale,
            )
        # Eager steps carry their lengths on the host (a captured graph's are placeholders).
        host_lens = meta.context_lens_host if meta.block_tables_host is not None else None
        if self.batch_invariant and host_lens is not None and q.shape[0] > 1:
            # Each row as a step of its own: gathers exactly its context, unmasked.
            return torch.cat([
                reference.decode_attention(q[i:i + 1], cache.k, cache.v, meta.block_tables[i:i + 1],
                                           meta.context_lens[i:i + 1], scale, cache.k_scale, cache.v_scale,
                                           host_lens[i:i + 1])
                for i in range(q.shape[0])
            ])
        return reference.decode_attention(q, cache.k, cache.v, meta.block_tables, meta.context_lens, scale,
                                          cache.k_scale, cache.v_scale, host_lens)
