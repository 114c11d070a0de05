"""The attention metadata of the step being run, reachable by every attention layer
without threading it through each model's forward signature. Set by a context manager
around one forward pass; never nested. The engine builds it, attention backends add what
they need (`AttentionBackend.prepare`), layers and kernels read it: it imports nothing
of theirs."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    """Where a step's tokens go and what they attend to.

    Tokens of all sequences are flattened: sequence i owns query rows
    `query_start_loc[i]:query_start_loc[i+1]`. `context_lens[i]` counts its tokens in the
    cache after this step's are written (cached prefix + new ones).
    """

    is_prefill: bool
    slot_mapping: torch.Tensor  # [num_tokens] int64; -1 = padding, not stored
    block_tables: torch.Tensor  # [batch, max_blocks] int32
    context_lens: torch.Tensor  # [batch] int32
    query_start_loc: torch.Tensor  # [batch + 1] int32
    max_query_len: int
    # Host copies, so the plain-PyTorch path never reads back from the device.
    query_lens_host: list[int]
    context_lens_host: list[int]
    # Decode (and a mixed step's decode rows), optional: the backend's zeroed int32
    # counters (allocated once: a fixed address for CUDA graphs) that let a split decode
    # kernel merge its splits in the same launch; each call leaves them zero. None: the
    # backend needs none, or merges in a second launch.
    decode_counters: torch.Tensor | None = None
    # A mixed step (is_prefill): the first num_decode sequences are decode rows, one query
    # token each, which a backend may run through its decode kernel.
    num_decode: int = 0
    # Decode only, optional: [batch] int32, the rows by context length, longest first
    # (`longest_first`); a decode kernel may take its sequences in this order.
    decode_order: torch.Tensor | None = None
    # Eager steps: the block tables on the host (graph steps: None).
    block_tables_host: np.ndarray | None = None
    # What the backend's `prepare` adds for its own kernels (e.g. where a prefill's
    # context rows sit in the cache); None when it adds nothing.
    backend_data: Any = None

    @property
    def batch_size(self) -> int:
        return self.block_tables.shape[0]


def longest_first(context_lens: np.ndarray) -> np.ndarray:
    """Row indices by context length, longest first (ties in row order), int32: the
    `decode_order` of a decode step."""
    return np.argsort(-context_lens.astype(np.int64), kind="stable").astype(np.int32)


_current: AttentionMetadata | None = None


@contextmanager
def forward_context(meta: AttentionMetadata) -> Iterator[AttentionMetadata]:
    global _current
    assert _current is None, "forward contexts do not nest"
    _current = meta
    try:
        yield meta
    finally:
        _current = None


def get_attention_metadata() -> AttentionMetadata:
    if _current is None:
        raise RuntimeError("attention layer called outside a forward_context")
    return _current
