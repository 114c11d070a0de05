"""Attention backends behind one protocol, found in a registry by (cache layout, device).

A backend is how the attention layers of one cache layout attend on one kind of device.
The engine makes one after building the model, from the layout its layers declare, and
binds it to every layer with that layer's cache view. What the engine calls is common to
all backends: `prepare` adds the backend's own fields to a step's metadata (for eager
steps and for the metadata captured in CUDA graphs), the constructor allocates what
every step shares (a workspace whose address the graphs capture), and
`eager_decode_batches` says which decode batches the start-up warm-up must run so that
nothing compiles later. The compute methods depend on the layout (a dense backend attends
with per-head K/V, an MLA backend over the latent), so only the layers call them.
"""

from __future__ import annotations

import importlib
from typing import ClassVar

import torch

from agent_infer.attention.metadata import AttentionMetadata
from agent_infer.config import ConfigError
from agent_infer.kvcache.layouts import CacheLayout


class AttentionBackend:
    name: ClassVar[str]
    # Whether eager decode rows read their context lengths from the host lists too, which
    # must then be exact (rows moved on the device are read back for it: a sync).
    reads_decode_lens_on_host: ClassVar[bool] = False

    def __init__(self, layer, max_batch: int, device: torch.device, batch_invariant: bool = False):
        """`layer`: one of the model's attention layers, whose `cache_layout` this backend
        reads and whose `num_heads` (query heads on this rank) it serves; `max_batch`: the
        most sequences in a step; `batch_invariant` (EngineConfig.batch_invariant): each
        decode row attends exactly as it would in a step of its own."""
        self.layout = layer.cache_layout
        self.num_heads = layer.num_heads
        self.max_batch = max_batch
        self.device = device
        self.batch_invariant = batch_invariant

    def prepare(self, meta: AttentionMetadata) -> AttentionMetadata:
        """The step's metadata with what this backend needs added (in place or a copy)."""
        return meta

    def eager_decode_batches(self, max_batch: int, mixed: bool) -> list[int]:
        """Decode-row counts whose eager steps compile every kernel variant that eager
        decode steps of up to `max_batch` rows need (`mixed`: the decode rows of mixed
        steps); [] when nothing is compiled on first use."""
        return []

    @classmethod
    def check_cache_dtype(cls, cache_dtype: torch.dtype, model_dtype: torch.dtype) -> None:
        """Refuse a KV-cache dtype this backend cannot read (default: any is fine)."""


# (layout kind, backend name) -> "module:class", imported when chosen.
_REGISTRY: dict[tuple[str, str], str] = {
    ("dense", "torch"): "agent_infer.attention.dense_torch:DenseTorchBackend",
    ("dense", "triton"): "agent_infer.attention.dense_triton:DenseTritonBackend",
    ("mla", "torch"): "agent_infer.attention.mla:LatentTorchBackend",
    ("mla", "triton"): "agent_infer.attention.mla:LatentTritonBackend",
}
# Which backend `auto` picks on each device type.
_DEFAULT = {"cuda": "triton", "cpu": "torch"}
# Backends that need a CUDA device.
_CUDA_ONLY = {"triton"}


def register_backend(kind: str, name: str, target: str) -> None:
    """Make `target` ("module:class") the backend `name` for layouts of `kind`."""
    _REGISTRY[(kind, name)] = target


def backend_names(kind: str) -> list[str]:
    return sorted(name for k, name in _REGISTRY if k == kind)


def backend_class(layout: CacheLayout, device: torch.device, name: str = "auto") -> type[AttentionBackend]:
    """The backend class for `layout` on `device`: `name`, or the device's default."""
    if name == "auto":
        name = _DEFAULT.get(device.type, "torch")
    target = _REGISTRY.get((layout.kind, name))
    if target is None:
        raise ConfigError(
            f"no attention backend {name!r} for the {layout.kind} cache layout; "
            f"available: {', '.join(backend_names(layout.kind))}"
        )
    if name in _CUDA_ONLY and device.type != "cuda":
        raise ConfigError(f"the {name} attention backend needs a CUDA device, not {device.type}")
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)
