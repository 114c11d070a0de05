"""Paged KV block allocator with reference counts and prefix caching.

A block holds `block_size` consecutive tokens of one sequence. Full blocks are keyed by
a chained hash (hash of the parent block's key and this block's tokens), so two prompts
that share a prefix share its blocks. A request's cache salt seeds the chain, so prompts
share blocks only with prompts of the same salt (tenants' caches stay apart: no timing
side channel across them). Freed blocks keep their contents and their key
until they are reused, least recently freed first: a later request with the same prefix
can still hit them.

Shared blocks are never written: a sequence only reuses blocks that lie wholly before
its last prompt token, so the token it computes first always lands in a block of its own.
"""

from __future__ import annotations

import functools
import hashlib
from collections import OrderedDict
from dataclasses import dataclass

from agent_infer.engine.structs import Sequence

_NO_HASH = -1


def chain_hash(parent: int, tokens: tuple[int, ...]) -> int:
    # Python's hash of a tuple of ints is the same in every process (PYTHONHASHSEED only
    # affects str/bytes). Collisions are harmless: a hit is confirmed by comparing tokens.
    return hash((parent, tokens))


@functools.lru_cache(maxsize=4096)
def chain_root(cache_salt: str | None) -> int:
    """The parent key of a sequence's first block: the salt's digest (the same in every
    process, unlike Python's hash of a str), or no parent when unsalted. Cached: the
    scheduler asks for it at every admission attempt and block commit."""
    if cache_salt is None:
        return _NO_HASH
    digest = hashlib.sha256(cache_salt.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "little", signed=True)


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens served from the cache


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.block_key = [_NO_HASH] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        # Free blocks in eviction order (front = first to reuse). OrderedDict gives O(1)
        # removal when a prefix hit revives a free block.
        self.free_blocks: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.key_to_block: dict[int, int] = {}
        self.stats = PrefixCacheStats()
        # Chained keys of each live sequence's full blocks, in order.
        self._seq_keys: dict[str, list[int]] = {}

    # ---- queries -------------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks that can serve the start of `seq` (without taking them)."""
        if not self.enable_prefix_caching or seq.sampling_params.prompt_logprobs is not None:
            return []  # prompt logprobs need every prompt position computed
        bs = self.block_size
        # Only blocks wholly before the last token: that token must be computed anyway.
        max_blocks = (seq.num_tokens - 1) // bs
        tokens = seq.all_token_ids
        hits: list[int] = []
        parent = chain_root(seq.cache_salt)
        for i in range(max_blocks):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            key = chain_hash(parent, chunk)
            block = self.key_to_block.get(key)
            if block is None or self.block_tokens[block] != chunk:
                break
            hits.append(block)
            parent = key
        return hits

    def prompt_block_keys(self, seq: Sequence, start_block: int, end_block: int) -> list[int]:
        """Chained keys of `seq`'s prompt blocks [start_block, end_block) (all full),
        continuing from its published keys where they reach start_block (the usual case:
        its cache hits, or the chunks launched before)."""
        bs, tokens = self.block_size, seq.prompt_token_ids
        known = self._seq_keys.get(seq.request_id, [])
        first = start_block if len(known) >= start_block else 0
        parent = known[first - 1] if first else chain_root(seq.cache_salt)
        keys = []
        for i in range(first, end_block):
            parent = chain_hash(parent, tuple(tokens[i * bs : (i + 1) * bs]))
            if i >= start_block:
                keys.append(parent)
        return keys

    def next_uncached_key(self, seq: Sequence, hits: list[int]) -> int | None:
        """Key of the block right after `seq`'s cache hits, if that block could itself be
        served from the cache once computed (it lies wholly before the last token)."""
        if not self.enable_prefix_caching or seq.sampling_params.prompt_logprobs is not None:
            return None
        i = len(hits)
        if i >= (seq.num_tokens - 1) // self.block_size:
            return None
        parent = self.block_key[hits[-1]] if hits else chain_root(seq.cache_salt)
        bs = self.block_size
        return chain_hash(parent, tuple(seq.all_token_ids[i * bs : (i + 1) * bs]))

    def num_blocks_to_take(self, seq: Sequence, hits: list[int], num_tokens: int) -> int:
        """Free blocks consumed if `seq` is given room for `num_tokens` reusing `hits`."""
        revived = sum(1 for b in hits if self.ref_count[b] == 0)
        return self.blocks_for(num_tokens) - len(hits) + revived

    # ---- allocation ----------------------------------------------------------------

    def allocate(self, seq: Sequence, hits: list[int], num_tokens: int) -> None:
        """Give `seq` a block table for `num_tokens` tokens, reusing the prefix `hits`."""
        assert not seq.block_table, f"request {seq.request_id} already holds blocks"
        needed = self.num_blocks_to_take(seq, hits, num_tokens)
        if needed > len(self.free_blocks):
            raise RuntimeError(f"allocate: need {needed} blocks, {len(self.free_blocks)} free")
        keys: list[int] = []
        for b in hits:
            if self.ref_count[b] == 0:
                del self.free_blocks[b]
            self.ref_count[b] += 1
            keys.append(self.block_key[b])
        seq.block_table = list(hits)
        for _ in range(self.blocks_for(num_tokens) - len(hits)):
            seq.block_table.append(self._take_free_block())
        self._seq_keys[seq.request_id] = keys
        cached = len(hits) * self.block_size
        seq.num_computed_tokens = cached
        seq.num_cached_tokens = cached
        self.stats.queries += seq.num_tokens
        self.stats.hits += cached

    def ensure_capacity(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow `seq`'s block table to hold `num_tokens`; False if there are too few free blocks."""
        extra = self.blocks_for(num_tokens) - len(seq.block_table)
        if extra > len(self.free_blocks):
            return False
        for _ in range(extra):
            seq.block_table.append(self._take_free_block())
        return True

    def blocks_needed_for(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def commit_full_blocks(self, seq: Sequence, limit: int | None = None) -> None:
        """Publish the keys of `seq`'s blocks that are now full of computed tokens (of its
        first `limit` tokens only, when given: those whose ids are known)."""
        if not self.enable_prefix_caching:
            return
        keys = self._seq_keys.get(seq.request_id)
        if keys is None:
            return
        bs = self.block_size
        num_full = (seq.num_computed_tokens if limit is None else min(limit, seq.num_computed_tokens)) // bs
        parent = keys[-1] if keys else chain_root(seq.cache_salt)
        for i in range(len(keys), num_full):
            chunk = tuple(seq.token_at(j) for j in range(i * bs, (i + 1) * bs))
            key = chain_hash(parent, chunk)
            block = seq.block_table[i]
            if key not in self.key_to_block:
                self.key_to_block[key] = block
                self.block_key[block] = key
                self.block_tokens[block] = chunk
            keys.append(key)
            parent = key

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references. Tail blocks go to the front of the eviction order so
        a shared prefix outlives the suffixes hanging off it."""
        for b in reversed(seq.block_table):
            self.ref_count[b] -= 1
            assert self.ref_count[b] >= 0, f"block {b} freed twice"
            if self.ref_count[b] == 0:
                self.free_blocks[b] = None
        seq.block_table = []
        self._seq_keys.pop(seq.request_id, None)

    def reset_prefix_cache(self) -> None:
        for b in list(self.key_to_block.values()):
            self.block_key[b] = _NO_HASH
            self.block_tokens[b] = None
        self.key_to_block.clear()

    def _take_free_block(self) -> int:
        block, _ = self.free_blocks.popitem(last=False)
        key = self.block_key[block]
        if key != _NO_HASH:
            # Evict: the block's old contents are about to be overwritten.
            if self.key_to_block.get(key) == block:
                del self.key_to_block[key]
            self.block_key[block] = _NO_HASH
            self.block_tokens[block] = None
        self.ref_count[block] = 1
        return block
