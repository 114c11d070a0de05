"""Addressing of the paged KV cache [num_blocks, block_size, Hkv, D] from a block table,
shared by the attention kernels. Keys are gathered one position at a time (position ->
table entry -> physical block), so a key tile may span several cache blocks and any
power-of-two block size works with any tile size. A tile that lies in one cache block
(`tile_row_offsets`) takes one table entry and rows at a fixed stride instead."""

from __future__ import annotations

import triton
import triton.language as tl

MAX_HEAD_DIM = 256


@triton.jit
def kv_block_ids(table_row_ptr, kpos, kmask, BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr):
    """Physical cache block of each key position in `kpos` [BLOCK_N] (int32, as the table
    holds them); loaded once per tile and shared by the K and V address computations.
    Positions are never negative: unsigned, the division by the power-of-two block size
    is one shift (signed, four instructions a value for sm_90)."""
    idx = (kpos.to(tl.uint32) // BLOCK_SIZE).to(tl.int32)
    if MASKED:
        block = tl.load(table_row_ptr + idx, mask=kmask, other=0)
    else:
        block = tl.load(table_row_ptr + idx)
    return block


@triton.jit
def kv_row_offsets(block, kpos, stride_block, stride_slot, BLOCK_SIZE: tl.constexpr):
    """Element offsets (int64) of the cache rows of key positions `kpos` in cache blocks
    `block`. Block ids and strides are non-negative 32-bit values, so their product is one
    32 x 32 -> 64-bit unsigned multiply; a signed 64-bit one took four instructions per
    key and the slot a signed remainder four more, in the loops that compute these
    offsets for every key a thread loads (tests/test_kernel_compile.py)."""
    blk = block.to(tl.uint32).to(tl.uint64) * stride_block.to(tl.uint32).to(tl.uint64)
    slot = (kpos.to(tl.uint32) % BLOCK_SIZE).to(tl.int32)
    return blk.to(tl.int64) + slot * stride_slot


@triton.jit
def tile_row_offsets(table_row_ptr, start, stride_block, stride_slot, BLOCK_SIZE: tl.constexpr,
                     BLOCK_N: tl.constexpr, ROW: tl.constexpr):
    """Element offsets (int64) of the cache rows of key positions start .. start + BLOCK_N - 1,
    a tile inside one cache block (BLOCK_SIZE a multiple of BLOCK_N, `start` a multiple of
    BLOCK_N, and below the context, so its table entry exists). One table entry a tile
    instead of one a key, and the rows at a fixed stride from one base: a thread's copies
    then differ by constants. ROW: the slot stride as a constant where the caller knows it
    (rows packed back to back), else 0 (`stride_slot` at run time)."""
    pos = tl.cast(start, tl.int32)  # a Python int under the interpreter
    if ROW > 0:
        stride = ROW
    else:
        stride = stride_slot
    # The tile's first row is a scalar (its block and slot as for any key); the per-key part
    # is then the same every tile.
    base = kv_row_offsets(kv_block_ids(table_row_ptr, pos, True, BLOCK_SIZE, False), pos, stride_block, stride,
                          BLOCK_SIZE)
    return base + tl.arange(0, BLOCK_N) * stride


@triton.jit
def whole_tiles_end(lo, hi, BLOCK_N: tl.constexpr):
    """The end of the whole key tiles of [lo, hi): a partial tile, if any, starts there."""
    return lo + tl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N


@triton.jit
def tile_load(ptrs, mask, MASKED: tl.constexpr):
    """A cache tile under `mask` (zeros elsewhere), or unmasked where the caller knows
    every element is in bounds (whole key tiles of unpadded rows): a mask per key row
    costs each vector a thread copies its own compare and predicate selects."""
    if MASKED:
        tile = tl.load(ptrs, mask=mask, other=0.0)
    else:
        tile = tl.load(ptrs)
    return tile


def check_head_dim(head_dim: int) -> int:
    """The padded tile width for head_dim; dims that are not powers of two (96) are masked."""
    if head_dim > MAX_HEAD_DIM or head_dim < 1:
        raise ValueError(f"head_dim {head_dim} is not supported by the Triton attention kernels (1..{MAX_HEAD_DIM})")
    return max(16, triton.next_power_of_2(head_dim))
