"""The throughput workloads: (prompts as token ids, per-request output lengths).

Shared by `bench throughput` (offline) and `bench serve` (through the HTTP server), so both
sides of a comparison draw the very same requests from the same function and seed. This
module imports neither torch nor NumPy at load time: the load generator runs without them.
"""

from __future__ import annotations

import random

NANO_VLLM_MAX_TOKEN_ID = 10000


def nano_vllm_workload(num_seqs: int, min_len: int, max_len: int, vocab: int,
                       seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """(prompts, output lengths) drawn exactly as nano-vllm's bench.py draws them: Python's
    `random` seeded with `seed`; for each prompt a length randint(min_len, max_len), then
    that many ids randint(0, 10000); after all prompts, each max_tokens randint(min_len,
    max_len). (A vocabulary of 10,000 tokens or fewer draws ids below its size instead.)"""
    rng = random.Random(seed)
    top = min(NANO_VLLM_MAX_TOKEN_ID, vocab - 1)
    prompts = [[rng.randint(0, top) for _ in range(rng.randint(min_len, max_len))] for _ in range(num_seqs)]
    return prompts, [rng.randint(min_len, max_len) for _ in range(num_seqs)]


def uniform_workload(num_seqs: int, min_len: int, max_len: int, vocab: int,
                     seed: int) -> tuple[list[list[int]], list[int]]:
    """(prompts, output lengths): lengths uniform in [min_len, max_len] (NumPy), ids over
    the whole vocabulary."""
    import numpy as np  # here, not at module level: see the module docstring

    rng = np.random.default_rng(seed)
    in_lens = rng.integers(min_len, max_len + 1, num_seqs)
    out_lens = rng.integers(min_len, max_len + 1, num_seqs)
    prompts = [rng.integers(0, vocab, int(n)).tolist() for n in in_lens]
    return prompts, [int(n) for n in out_lens]


def redraw_ids(prompts: list[list[int]], vocab: int, seed: int) -> list[list[int]]:
    """Prompts of the same lengths with new random ids (Python's `random`, ids below
    min(10000, vocab - 1) + 1, as the draw's): a later run of the same shape that a
    server's prefix cache cannot serve from an earlier one."""
    rng = random.Random(seed)
    top = min(NANO_VLLM_MAX_TOKEN_ID, vocab - 1)
    return [[rng.randint(0, top) for _ in p] for p in prompts]


WORKLOADS = {"nano-vllm": nano_vllm_workload, "uniform": uniform_workload}
