"""Addressing of the paged KV cache [num_blocks, block_size, Hkv, D] from a block table,
shared by the attention kernels. Keys are gathered one position at a time (position ->
table entry -> physical block), so a key tile may span several cache blocks and any
power-of-two block size works with any tile size."""

from __future__ import annotations

import triton
import triton.language as tl

MAX_HEAD_DIM = 256


@triton.jit
def kv_block_ids(table_row_ptr, kpos, kmask, BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr):
    """Physical cache block (int64) of each key position in `kpos` [BLOCK_N]; loaded once
    per tile and shared by the K and V address computations."""
    if MASKED:
        block = tl.load(table_row_ptr + kpos // BLOCK_SIZE, mask=kmask, other=0)
    else:
        block = tl.load(table_row_ptr + kpos // BLOCK_SIZE)
    return block.to(tl.int64)


def check_head_dim(head_dim: int) -> int:
    """The padded tile width for head_dim; dims that are not powers of two (96) are masked."""
    if head_dim > MAX_HEAD_DIM or head_dim < 1:
        raise ValueError(f"head_dim {head_dim} is not supported by the Triton attention kernels (1..{MAX_HEAD_DIM})")
    return max(16, triton.next_power_of_2(head_dim))
