"""The KV pool sizes and allocates any cache layout the model declares: dense K/V per KV
head, and MLA's one latent row per token (kv_lora_rank + rope dims, not split by TP),
side by side; each layer gets a typed view of its own slice."""

from __future__ import annotations

import numpy as np
import torch

from agent_infer.kvcache.layouts import DenseKVCache, DenseKVLayout, LatentCache, LatentLayout
from agent_infer.kvcache.pool import KVMemoryPool, bytes_per_token
from agent_infer.kvcache.slots import ragged_slots

BLOCK = 16


def test_mla_latent_and_dense_layouts_in_one_pool():
    # DeepSeek-V2-Lite's 27 latent layers (512 + 64) next to 2 dense layers of 4 KV heads x 128.
    mla, dense = LatentLayout(kv_lora_rank=512, rope_dim=64), DenseKVLayout(num_kv_heads=4, head_dim=128)
    layouts = [mla] * 27 + [dense] * 2
    assert mla.values_per_token == 576 and dense.values_per_token == 1024
    # bf16: 27 x 576 x 2 = 31,104 B per token for the latent layers + 2 x 1024 x 2.
    assert bytes_per_token([mla] * 27, torch.bfloat16) == 31104
    per_token = bytes_per_token(layouts, torch.bfloat16)
    assert per_token == 31104 + 2 * 1024 * 2

    budget = KVMemoryPool.estimate_num_blocks(per_token * BLOCK, torch.device("cpu"), 0.9, kv_cache_bytes=10 << 20)
    assert budget.num_blocks == (10 << 20) // (per_token * BLOCK) == 18

    pool = KVMemoryPool(layouts, BLOCK, budget.num_blocks, torch.bfloat16, torch.device("cpu"))
    assert pool.nbytes == budget.num_blocks * BLOCK * per_token and pool.dtype == torch.bfloat16
    assert len(pool.tensors) == 2  # one tensor per distinct layout
    views = pool.views
    assert len(views) == 29
    for v in views[:27]:
        assert isinstance(v, LatentCache)
        assert v.kv.shape == (18, BLOCK, 576) and v.kv.dtype == torch.bfloat16
        assert v.latent.shape == (18, BLOCK, 512) and v.rope.shape == (18, BLOCK, 64)
    for v in views[27:]:
        assert isinstance(v, DenseKVCache)
        assert v.k.shape == v.v.shape == (18, BLOCK, 4, 128)

    # Every layer's view is its own memory: a write to one layer shows in no other.
    views[3].latent[5, 7].fill_(1.0)
    views[3].rope[5, 7].fill_(2.0)
    views[28].v[2, 0].fill_(3.0)
    assert views[3].kv[5, 7, :512].eq(1).all() and views[3].kv[5, 7, 512:].eq(2).all()
    assert all(not v.kv.any() for i, v in enumerate(views[:27]) if i != 3)
    assert not views[27].k.any() and not views[27].v.any() and not views[28].k.any()
    assert views[28].v.sum() == 3.0 * 128 * 4


def test_dense_layout_heads_are_per_rank():
    # The layer declares its own rank's heads: 8 KV heads at TP = 2 cache 4 per rank.
    layout = DenseKVLayout(num_kv_heads=4, head_dim=128)
    assert bytes_per_token([layout] * 36, torch.bfloat16) == 36 * 2 * 4 * 128 * 2
    pool = KVMemoryPool([layout] * 3, BLOCK, 5, torch.float8_e4m3fn, torch.device("cpu"))
    assert pool.nbytes == 3 * 5 * BLOCK * 2 * 4 * 128
    assert pool.views[0].k.dtype == torch.float8_e4m3fn


def test_ragged_slots_follow_each_sequences_block_table():
    """Tokens of sequences that start mid-block, cross blocks or are empty, against the
    slot of each token worked out one by one."""
    rng = np.random.default_rng(0)
    tables = rng.permutation(80).reshape(4, 20).astype(np.int32)
    starts, lengths = np.array([0, 13, 5, 31]), np.array([20, 0, 1, 40], dtype=np.int32)
    positions, slots, cu = ragged_slots(tables, starts, lengths, 4)
    want = [(p, tables[i, p // 4] * 4 + p % 4) for i in range(4) for p in range(starts[i], starts[i] + lengths[i])]
    assert positions.tolist() == [p for p, _ in want]
    assert slots.tolist() == [s for _, s in want]
    assert cu.tolist() == [0, 20, 20, 21, 61] and cu.dtype == np.int32
