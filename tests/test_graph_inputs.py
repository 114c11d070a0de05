"""The decode graphs' per-row inputs: packed for one host-to-device copy per step, padded
to the graph size, with every graph size reading its own views (CPU: the packing only;
tests/gpu/test_engine_gpu.py replays the graphs)."""

from __future__ import annotations

import numpy as np
import torch

from agent_infer.engine.cuda_graphs import RowInputs, _RowStaging
from agent_infer.engine.host_step import HostStep


def _step(b: int, placeholders: bool) -> HostStep:
    rng = np.random.default_rng(b)
    return HostStep(
        is_prefill=False,
        input_ids=rng.integers(0, 1000, b),
        positions=rng.integers(0, 4000, b),
        slot_mapping=rng.integers(0, 2**40, b),  # past int32: must stay int64
        block_tables=np.zeros((b, 4), dtype=np.int32),
        context_lens=rng.integers(1, 4000, b).astype(np.int32),
        query_lens=np.ones(b, dtype=np.int32),
        query_start_loc=np.arange(b + 1, dtype=np.int32),
        sample_indices=np.arange(b),
        prev_index=np.where(rng.random(b) < 0.5, rng.integers(0, b, b), -1) if placeholders else None,
        follow=np.where(rng.random(b) < 0.5, rng.integers(0, b, b), -1) if placeholders else None,
        follow_k=rng.integers(1, 8, b) if placeholders else None,
    )


def test_rows_are_packed_padded_and_exact():
    staging = _RowStaging(16, torch.device("cpu"))
    for b, size, placeholders in [(3, 4, True), (16, 16, False), (1, 1, True), (5, 8, False)]:
        step = _step(b, placeholders)
        rows = staging.load(step, size)
        assert rows.input_ids.data_ptr() == staging.dev.data_ptr(), "rows start the buffer: one copy of a prefix"
        pad = size - b
        assert rows.input_ids.tolist() == step.input_ids.tolist() + [0] * pad
        assert rows.positions.tolist() == step.positions.tolist() + [0] * pad
        assert rows.slots.tolist() == step.slot_mapping.tolist() + [-1] * pad
        assert rows.context_lens.dtype == torch.int32
        assert rows.context_lens.tolist() == step.context_lens.tolist() + [1] * pad
        # Every row once, longest context first; padding rows (context 1) after the real ones.
        order = rows.order.tolist()
        assert rows.order.dtype == torch.int32 and sorted(order) == list(range(size))
        lens = rows.context_lens.tolist()
        assert [lens[i] for i in order] == sorted(lens, reverse=True)
        assert order[b:] == list(range(b, size))
        want_prev = step.prev_index.tolist() + [-1] * pad if placeholders else [-1] * size
        assert rows.prev_index.tolist() == want_prev
        assert rows.follow.tolist() == (step.follow.tolist() + [-1] * pad if placeholders else [-1] * size)
        assert rows.follow_k.tolist() == (step.follow_k.tolist() + [0] * pad if placeholders else [0] * size)
        assert all(t.is_contiguous() and t.numel() == size for t in vars(rows).values())


def test_each_size_has_its_own_views_and_host_buffers_alternate():
    flat = torch.arange(7 * 8, dtype=torch.int64)
    small, large = RowInputs.of(flat, 2), RowInputs.of(flat, 8)
    assert small.positions.tolist() == [4, 5] and large.positions.tolist() == list(range(16, 24))
    assert small.follow_k.tolist() == [10, 11] and large.follow_k.tolist() == list(range(40, 48))
    # The last row's two int32 halves: context lengths, then the order; nothing past it.
    assert small.context_lens.data_ptr() + 8 == small.order.data_ptr() == flat[13].data_ptr()
    assert large.order.data_ptr() + 4 * 8 == flat[56 - 1].data_ptr() + 8
    staging = _RowStaging(8, torch.device("cpu"))
    first = staging.hosts[staging.turn]
    staging.load(_step(2, False), 2)
    assert staging.hosts[staging.turn] is not first, "the next step must stage into the other buffer"
