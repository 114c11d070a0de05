"""Read a safetensors checkpoint tensor by tensor.

Each tensor comes as a `LazyWeight`: nothing is read until a parameter's loader asks
for the whole tensor or for the slice its rank owns (`get_slice`), so a TP rank reads
only its shard and the host never holds a second full copy of the model.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import ExitStack

import torch
from safetensors import safe_open


class LazyWeight:
    def __init__(self, handle, name: str):
        self._handle = handle
        self.name = name
        self._slice = handle.get_slice(name)
        self.shape = tuple(self._slice.get_shape())

    def load(self) -> torch.Tensor:
        return self._handle.get_tensor(self.name)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._slice[tuple(index)]


Weight = torch.Tensor | LazyWeight


def shape_of(w: Weight) -> tuple[int, ...]:
    return tuple(w.shape)


def narrow(w: Weight, dim: int, start: int, length: int) -> torch.Tensor:
    if isinstance(w, LazyWeight):
        return w.narrow(dim, start, length)
    return w.narrow(dim, start, length)


def materialize(w: Weight) -> torch.Tensor:
    return w.load() if isinstance(w, LazyWeight) else w


def checkpoint_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, f) for f in files]
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {path}")
    return [os.path.join(path, f) for f in files]


def iter_weights(path: str) -> Iterator[tuple[str, LazyWeight]]:
    with ExitStack() as stack:
        for file in checkpoint_files(path):
            handle = stack.enter_context(safe_open(file, framework="pt", device="cpu"))
            for name in handle.keys():
                yield name, LazyWeight(handle, name)


def copy_into(param: torch.Tensor, loaded: torch.Tensor, name: str = "") -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"weight {name}: checkpoint shape {tuple(loaded.shape)} != parameter shape {tuple(param.shape)}")
    param.data.copy_(loaded.to(param.dtype))
