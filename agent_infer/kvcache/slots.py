"""Where tokens sit in the paged cache: a token at position p of a sequence lives in slot
table[p // block_size] * block_size + p % block_size."""

from __future__ import annotations

import numpy as np


def ragged_slots(
    tables: np.ndarray, starts: np.ndarray, lengths: np.ndarray, block_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sequence i's tokens at positions starts[i] .. starts[i] + lengths[i] - 1, all
    sequences in order: (their positions [N] int64, their cache slots [N] int64 through
    row i of `tables` [B, max_blocks], the cumulative lengths [B + 1] int32)."""
    owner = np.repeat(np.arange(len(lengths)), lengths)
    cu = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=cu[1:])
    positions = np.asarray(starts, dtype=np.int64)[owner] + (np.arange(len(owner)) - cu[owner])
    slots = tables[owner, positions // block_size].astype(np.int64) * block_size + positions % block_size
    return positions, slots, cu
