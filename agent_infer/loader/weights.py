"""Read a safetensors checkpoint tensor by tensor.

Each tensor comes as a `LazyWeight`: nothing is read until a parameter's loader asks
for the whole tensor or for the slice its rank owns (`narrow`), so a TP rank reads only
its shard, an expert-parallel rank only its experts, and the host never holds a second
full copy of the model. A `ReadCounter` passed to `iter_weights` adds up the bytes read.

A checkpoint that cannot be read (a shard the index names but the folder lacks, a
truncated or corrupt file, an index that is not JSON) is a `CheckpointError` naming the
file and what is wrong.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field

import torch
from safetensors import safe_open

from agent_infer.config import ConfigError


class CheckpointError(ConfigError):
    """A checkpoint file that cannot be read; the message names it."""


@dataclass
class ReadCounter:
    bytes_read: int = 0
    by_tensor: dict[str, int] = field(default_factory=dict)  # checkpoint name -> bytes read of it


class LazyWeight:
    def __init__(self, handle, name: str, file: str, counter: ReadCounter | None = None):
        self._handle = handle
        self.name = name
        self.file = file
        self._counter = counter
        self._slice = handle.get_slice(name)
        self.shape = tuple(self._slice.get_shape())
        self.stored_dtype = self._slice.get_dtype()  # safetensors' name: "BF16", "F8_E4M3", ...

    def load(self) -> torch.Tensor:
        return self._count(self._read(lambda: self._handle.get_tensor(self.name)))

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._count(self._read(lambda: self._slice[tuple(index)]))

    def _read(self, read):
        try:
            return read()
        except Exception as e:  # safetensors raises its own error types for bad data
            raise CheckpointError(f"{self.file}: tensor {self.name} cannot be read ({e})") from None

    def _count(self, t: torch.Tensor) -> torch.Tensor:
        if self._counter is not None:
            n = t.numel() * t.element_size()
            self._counter.bytes_read += n
            self._counter.by_tensor[self.name] = self._counter.by_tensor.get(self.name, 0) + n
        return t


# A checkpoint tensor: in memory, or anything with `shape`, `load()` and `narrow()` that
# reads it when asked (LazyWeight; quantization/fp8.py's Fp8Weight, which dequantizes).
Weight = torch.Tensor | LazyWeight


def shape_of(w: Weight) -> tuple[int, ...]:
    return tuple(w.shape)


def narrow(w: Weight, dim: int, start: int, length: int) -> torch.Tensor:
    """The slice along `dim`; read from disk for a lazy handle (a tensor's `narrow` and
    the handle's share the signature)."""
    return w.narrow(dim, start, length)


def materialize(w: Weight) -> torch.Tensor:
    return w if isinstance(w, torch.Tensor) else w.load()


def checkpoint_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{index} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
        except (KeyError, TypeError, AttributeError):
            raise CheckpointError(f"{index} has no 'weight_map' object naming the shard files") from None
        missing = [f for f in files if not os.path.isfile(os.path.join(path, f))]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise CheckpointError(f"{index} names {missing[0]}{more}, which is not in {path}")
        return [os.path.join(path, f) for f in files]
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"no .safetensors weights in {path}")
    return [os.path.join(path, f) for f in files]


def _open(stack: ExitStack, file: str):
    # safetensors checks the header against the file's size, so a truncated file fails here.
    try:
        return stack.enter_context(safe_open(file, framework="pt", device="cpu"))
    except Exception as e:  # safetensors' own error type, or an OSError
        raise CheckpointError(f"{file} is not a readable safetensors file ({e})") from None


def iter_weights(path: str, counter: ReadCounter | None = None) -> Iterator[tuple[str, LazyWeight]]:
    with ExitStack() as stack:
        for file in checkpoint_files(path):
            handle = _open(stack, file)
            for name in handle.keys():
                yield name, LazyWeight(handle, name, file, counter)


def copy_into(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"checkpoint shape {tuple(loaded.shape)} != parameter shape {tuple(param.shape)}")
    param.data.copy_(loaded.to(param.dtype))
