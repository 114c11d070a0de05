"""BlockManager: allocation, freeing, reference counts, prefix-cache reuse and eviction."""

from __future__ import annotations

import pytest

from agent_infer.engine.block_manager import BlockManager
from agent_infer.engine.structs import Sequence
from agent_infer.sampling_params import SamplingParams

BS = 4


def seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(), max_tokens=8, seed=0)


def admit(bm: BlockManager, s: Sequence) -> list[int]:
    hits = bm.match_prefix(s)
    bm.allocate(s, hits, s.num_tokens)
    return hits


def test_allocate_and_free_return_every_block():
    bm = BlockManager(10, BS)
    a = seq(range(10), "a")  # 3 blocks
    admit(bm, a)
    assert len(a.block_table) == 3 and len(set(a.block_table)) == 3
    assert bm.get_num_free_blocks() == 7
    assert all(bm.ref_count[b] == 1 for b in a.block_table)
    bm.free(a)
    assert bm.get_num_free_blocks() == 10 and a.block_table == []
    assert all(c == 0 for c in bm.ref_count)


def test_allocate_more_than_free_raises():
    bm = BlockManager(2, BS)
    with pytest.raises(RuntimeError):
        admit(bm, seq(range(9)))


def test_shared_prefix_reuses_blocks_and_counts_refs():
    bm = BlockManager(16, BS)
    a = seq(list(range(100, 110)), "a")  # blocks: [100..103] [104..107] [108,109]
    admit(bm, a)
    a.num_computed_tokens = a.num_tokens
    bm.commit_full_blocks(a)
    b = seq(list(range(100, 108)) + [7, 7, 7], "b")
    hits = admit(bm, b)
    assert hits == a.block_table[:2]
    assert b.num_cached_tokens == 8 and b.num_computed_tokens == 8
    assert [bm.ref_count[x] for x in hits] == [2, 2]
    assert b.block_table[2] not in a.block_table
    assert bm.stats.hits == 8
    bm.free(a)
    assert [bm.ref_count[x] for x in hits] == [1, 1]
    bm.free(b)
    assert bm.get_num_free_blocks() == 16


def test_fully_cached_prompt_still_computes_its_last_token():
    bm = BlockManager(16, BS)
    a = seq(list(range(8)), "a")  # exactly two full blocks
    admit(bm, a)
    a.num_computed_tokens = 8
    bm.commit_full_blocks(a)
    b = seq(list(range(8)), "b")
    hits = admit(bm, b)
    # Only the first block is reused: the second holds the last token, which b recomputes
    # into a block of its own (shared blocks are never written).
    assert hits == a.block_table[:1]
    assert b.num_computed_tokens == 4 and b.num_uncomputed_tokens == 4
    assert b.block_table[1] != a.block_table[1]


def test_freed_blocks_stay_cached_until_reused():
    bm = BlockManager(4, BS)
    a = seq(list(range(9)), "a")  # 3 blocks, 2 full
    admit(bm, a)
    a.num_computed_tokens = 9
    bm.commit_full_blocks(a)
    first_two = a.block_table[:2]
    bm.free(a)
    b = seq(list(range(8)) + [50, 51], "b")
    assert admit(bm, b) == first_two  # revived from the free list
    assert bm.get_num_free_blocks() == 1
    bm.free(b)
    # Fill the whole pool with unrelated tokens: the cached blocks are evicted.
    c = seq(list(range(500, 516)), "c")
    admit(bm, c)
    bm.free(c)
    d = seq(list(range(8)) + [1], "d")
    assert bm.match_prefix(d) == []


def test_chained_hash_requires_the_same_prefix():
    bm = BlockManager(16, BS)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 9], "a")
    admit(bm, a)
    a.num_computed_tokens = 9
    bm.commit_full_blocks(a)
    # Same second block, different first block: no hit at all.
    b = seq([9, 9, 9, 9, 5, 6, 7, 8, 9], "b")
    assert bm.match_prefix(b) == []


def test_cache_salt_shares_blocks_only_under_the_same_salt():
    bm = BlockManager(32, BS)
    prompt = list(range(100, 113))  # three full blocks before the last token

    def run(salt, rid):
        s = Sequence(rid, list(prompt), SamplingParams(), max_tokens=8, seed=0, cache_salt=salt)
        hits = admit(bm, s)
        s.num_computed_tokens = s.num_tokens
        bm.commit_full_blocks(s)
        bm.free(s)
        return len(hits)

    assert run("tenant-a", "a1") == 0
    assert run("tenant-a", "a2") == 3  # same salt: every full block
    assert run("tenant-b", "b1") == 0  # another salt: not even the first block
    assert run(None, "n1") == 0  # unsalted requests share only with each other
    assert run(None, "n2") == 3 and run("tenant-b", "b2") == 3
    # The salt seeds the chain, so the keys of later blocks differ too (not just the first).
    a = Sequence("ka", list(prompt), SamplingParams(), max_tokens=8, seed=0, cache_salt="tenant-a")
    b = Sequence("kb", list(prompt), SamplingParams(), max_tokens=8, seed=0, cache_salt="tenant-b")
    assert not set(bm.prompt_block_keys(a, 0, 3)) & set(bm.prompt_block_keys(b, 0, 3))


def test_decode_growth_and_generated_blocks_are_cached():
    bm = BlockManager(8, BS)
    a = seq([1, 2, 3], "a")
    admit(bm, a)
    assert len(a.block_table) == 1
    a.num_computed_tokens = 3
    a.output_token_ids += [4, 5]
    assert bm.ensure_capacity(a, a.num_tokens)
    assert len(a.block_table) == 2
    a.num_computed_tokens = 4
    bm.commit_full_blocks(a)
    b = seq([1, 2, 3, 4, 9], "b")
    assert bm.match_prefix(b) == a.block_table[:1]


def test_ensure_capacity_fails_without_free_blocks():
    bm = BlockManager(1, BS)
    a = seq([1, 2, 3, 4], "a")
    admit(bm, a)
    a.output_token_ids.append(5)
    assert not bm.ensure_capacity(a, a.num_tokens)
    assert len(a.block_table) == 1


def test_prefix_caching_disabled_never_hits():
    bm = BlockManager(16, BS, enable_prefix_caching=False)
    a = seq(list(range(9)), "a")
    admit(bm, a)
    a.num_computed_tokens = 9
    bm.commit_full_blocks(a)
    assert bm.match_prefix(seq(list(range(9)), "b")) == []
