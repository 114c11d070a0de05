"""Checks of the fused all-reduce + residual add + RMSNorm kernel
(`agent_infer/kernels/triton/allreduce_norm.py`), shared by the CPU test (two processes
running the kernel through Triton's interpreter on shared-memory buffers, see
`run_interpreter_ranks`) and tests/gpu/test_fused_allreduce_gpu.py (two GPUs, PyTorch
symmetric memory).

The reference is the unfused path: the all-reduce (fp32 sum in rank order, rounded to
the activation dtype), then `reference.fused_add_rms_norm`. Inputs are random, never
zeros, and differ per rank and per call, so a stale or wrong buffer half, a row read
from the wrong peer or a missed barrier changes the result.
"""

from __future__ import annotations

import time
import traceback

import torch

from agent_infer.kernels import reference

EPS = 1e-6


def case_inputs(m: int, h: int, world: int, dtype: torch.dtype, seed: int) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Every rank's partial output y, the (replicated) residual and the norm weight, on
    CPU; the same on every rank for the same arguments."""
    g = torch.Generator().manual_seed(seed)
    ys = [(torch.randn(m, h, generator=g) + 0.1).to(dtype) for _ in range(world)]
    residual = (torch.randn(m, h, generator=g) * 2 + 0.05).to(dtype)
    weight = (torch.rand(h, generator=g) + 0.5).to(dtype)
    return ys, residual, weight


def expected(ys: list[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor, eps: float = EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, new residual) of all_reduce_sum(y) followed by fused_add_rms_norm."""
    s = torch.zeros(ys[0].shape, dtype=torch.float32, device=ys[0].device)
    for y in ys:
        s += y.float()
    return reference.fused_add_rms_norm(s.to(ys[0].dtype), residual.clone(), weight, eps)


# ---- CPU: two processes through Triton's interpreter --------------------------------------

# (rows, cols) of the calls each rank makes back to back, in this order: different row
# counts change the grid (and, past max_programs, make programs loop over rows).
INTERPRETER_CALLS = [(3, 200), (1, 200), (5, 200), (5, 200), (2, 96), (7, 200), (1, 96), (4, 200)]
INTERPRETER_MAX_PROGRAMS = 3


def run_interpreter_ranks(dtype: torch.dtype, world: int = 2, timeout_s: float = 600.0) -> None:
    """Run INTERPRETER_CALLS on `world` processes (the caller's environment must have
    TRITON_INTERPRET=1, which the children inherit) and check every call on every rank
    against the reference, and the ranks against each other bit for bit."""
    import torch.multiprocessing as mp

    max_rows = max(m for m, _ in INTERPRETER_CALLS)
    max_cols = max(h for _, h in INTERPRETER_CALLS)
    half = max_rows * max_cols
    buffers = [torch.full((2 * half,), float("nan"), dtype=dtype).share_memory_() for _ in range(world)]
    pads = [torch.zeros(INTERPRETER_MAX_PROGRAMS * world, dtype=torch.int32).share_memory_() for _ in range(world)]
    outs = [[torch.zeros(m, h, dtype=dtype).share_memory_() for m, h in INTERPRETER_CALLS] for _ in range(world)]
    ress = [[torch.zeros(m, h, dtype=dtype).share_memory_() for m, h in INTERPRETER_CALLS] for _ in range(world)]
    epochs = torch.zeros(world, INTERPRETER_MAX_PROGRAMS, dtype=torch.int32).share_memory_()
    status = torch.zeros(world, dtype=torch.int32).share_memory_()  # 1 = ready, 2 = done, 3 = failed
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    procs = [
        ctx.Process(
            target=_interpreter_rank, args=(r, world, dtype, buffers, pads, outs[r], ress[r], epochs[r], status, errors)
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    messages = []
    while not errors.empty():
        messages.append(errors.get())
    assert not hung, f"ranks {hung} still running after {timeout_s} s (a barrier that never opens?)"
    assert status.tolist() == [2] * world, f"rank status {status.tolist()}:\n" + "\n".join(messages)
    for i, (m, h) in enumerate(INTERPRETER_CALLS):
        ys, residual, weight = case_inputs(m, h, world, dtype, seed=100 + i)
        ref_out, ref_res = expected(ys, residual, weight)
        for r in range(world):
            assert torch.equal(outs[r][i], outs[0][i]) and torch.equal(ress[r][i], ress[0][i]), (
                f"call {i} ({m}x{h}): rank {r} differs from rank 0"
            )
        from tests.kernel_checks import assert_close

        assert_close(ress[0][i], ref_res, f"call {i} ({m}x{h}) residual")
        assert_close(outs[0][i], ref_out, f"call {i} ({m}x{h}) output")
    for r in range(world):
        assert not pads[r].any(), f"rank {r}'s signal pad is not back to zero: {pads[r].tolist()}"
    # Every program slot counted every call, and the last call left its rows in the half
    # its count picked (the other half still holds the call before: the double buffer).
    calls = len(INTERPRETER_CALLS)
    m, h = INTERPRETER_CALLS[-1]
    ys, _, _ = case_inputs(m, h, world, dtype, seed=100 + calls - 1)
    start = (calls - 1) % 2 * half
    for r in range(world):
        assert epochs[r].tolist() == [calls] * INTERPRETER_MAX_PROGRAMS, f"rank {r}: call counts {epochs[r].tolist()}"
        assert torch.equal(buffers[r][start:start + m * h].view(m, h), ys[r]), f"rank {r}: last rows not in their half"


def _interpreter_rank(rank, world, dtype, buffers, pads, outs, ress, epochs, status, errors) -> None:
    try:
        from tests.kernel_checks import patch_interpreter_scalar_index

        patch_interpreter_scalar_index()
        from agent_infer.kernels.triton.allreduce_norm import PeerBuffers, all_reduce_add_rms_norm

        # Each process maps the shared buffers at its own addresses, as symmetric memory does.
        peers = PeerBuffers(
            buffer_ptrs=torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64),
            pad_ptrs=torch.tensor([p.data_ptr() for p in pads], dtype=torch.int64),
            epochs=torch.zeros(INTERPRETER_MAX_PROGRAMS, dtype=torch.int32),
            error=torch.zeros(1, dtype=torch.int32),
            rank=rank,
            world_size=world,
            half_numel=buffers[0].numel() // 2,
            max_programs=INTERPRETER_MAX_PROGRAMS,
            max_spins=20_000,  # ~10 s in the interpreter; the ranks start together (below)
        )
        status[rank] = 1
        while (status == 0).any():
            if (status == 3).any():
                raise RuntimeError("a peer failed before the first call")
        for i, (m, h) in enumerate(INTERPRETER_CALLS):
            ys, residual, weight = case_inputs(m, h, world, dtype, seed=100 + i)
            x = ys[rank].clone()
            out, res = all_reduce_add_rms_norm(x, residual, weight, EPS, peers)
            assert out is x and res is residual, "the fused op must work in place and return its inputs"
            outs[i].copy_(out)
            ress[i].copy_(res)
            assert peers.error.item() == 0, f"call {i}: a barrier wait ran out of spins"
        epochs.copy_(peers.epochs)
        status[rank] = 2
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        status[rank] = 3


# ---- the batch-1 GEMV that pushes its row to the peers (gemv_allreduce.py) ---------------

# (features N, inputs K of this rank's shard) of each call, back to back; two call sites
# (counters) alternate, as o_proj and down_proj do.
GEMV_CALLS = [(96, 64), (96, 128), (40, 64), (96, 64), (96, 128), (17, 32), (96, 64)]
GEMV_REGION = 128


def gemv_case(n: int, k: int, world: int, dtype: torch.dtype, seed: int):
    """Per rank x [1, k] and weight shard [n, k]; residual, norm weight and rank 0's bias."""
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(1, k, generator=g).to(dtype) for _ in range(world)]
    ws = [(torch.randn(n, k, generator=g) * k**-0.5).to(dtype) for _ in range(world)]
    bias = torch.randn(n, generator=g).to(dtype)
    residual = (torch.randn(1, n, generator=g) * 2).to(dtype)
    weight = (torch.rand(n, generator=g) + 0.5).to(dtype)
    return xs, ws, bias, residual, weight


def gemv_expected(xs, ws, bias, residual, weight):
    """Each rank's GEMV rounded to the dtype (rank 0 with the bias), then `expected`."""
    ys = [torch.nn.functional.linear(x.float(), w.float(), bias.float() if r == 0 else None).to(x.dtype)
          for r, (x, w) in enumerate(zip(xs, ws))]
    return expected(ys, residual, weight)


def run_interpreter_gemv_ranks(dtype: torch.dtype, world: int = 2, timeout_s: float = 600.0) -> None:
    """GEMV_CALLS on `world` processes through the interpreter, buffers and pads in shared
    memory: every call on every rank against the reference, ranks bit for bit alike, the
    counters re-armed and the call number advanced once per call."""
    import torch.multiprocessing as mp

    buffers = [torch.full((2 * world * GEMV_REGION,), float("nan"), dtype=dtype).share_memory_() for _ in range(world)]
    pads = [torch.zeros(world, dtype=torch.int32).share_memory_() for _ in range(world)]
    outs = [[torch.zeros(1, n, dtype=dtype).share_memory_() for n, _ in GEMV_CALLS] for _ in range(world)]
    ress = [[torch.zeros(1, n, dtype=dtype).share_memory_() for n, _ in GEMV_CALLS] for _ in range(world)]
    calls = torch.zeros(world, dtype=torch.int32).share_memory_()
    status = torch.zeros(world, dtype=torch.int32).share_memory_()
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    procs = [ctx.Process(target=_interpreter_gemv_rank,
                         args=(r, world, dtype, buffers, pads, outs[r], ress[r], calls, status, errors))
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    messages = []
    while not errors.empty():
        messages.append(errors.get())
    assert not hung, f"ranks {hung} still running after {timeout_s} s (a flag that never comes?)"
    assert status.tolist() == [2] * world, f"rank status {status.tolist()}:\n" + "\n".join(messages)
    from tests.kernel_checks import assert_close

    for i, (n, k) in enumerate(GEMV_CALLS):
        ref_out, ref_res = gemv_expected(*gemv_case(n, k, world, dtype, seed=200 + i))
        for r in range(world):
            assert torch.equal(outs[r][i], outs[0][i]) and torch.equal(ress[r][i], ress[0][i]), (
                f"call {i} ({n}x{k}): rank {r} differs from rank 0"
            )
        assert_close(ress[0][i], ref_res, f"gemv call {i} ({n}x{k}) residual", dtype)
        assert_close(outs[0][i], ref_out, f"gemv call {i} ({n}x{k}) output", dtype)
    assert calls.tolist() == [len(GEMV_CALLS)] * world, f"call numbers {calls.tolist()}"
    for r in range(world):
        assert pads[r].tolist() == [len(GEMV_CALLS) if q != r else 0 for q in range(world)], (
            f"rank {r}'s flags {pads[r].tolist()}: each peer's flag holds the last call's number"
        )


def _interpreter_gemv_rank(rank, world, dtype, buffers, pads, outs, ress, calls, status, errors) -> None:
    try:
        from tests.kernel_checks import patch_interpreter_scalar_index

        patch_interpreter_scalar_index()
        from agent_infer.kernels.triton.gemv_allreduce import PushBuffers, gemv_all_reduce_add_rms_norm

        peers = PushBuffers(
            buffer_ptrs=torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64),
            pad_ptrs=torch.tensor([p.data_ptr() for p in pads], dtype=torch.int64),
            call=torch.zeros(1, dtype=torch.int32),
            error=torch.zeros(1, dtype=torch.int32),
            rank=rank,
            world_size=world,
            region_numel=GEMV_REGION,
            max_spins=20_000,
        )
        counters = [torch.zeros(1, dtype=torch.int32) for _ in range(2)]
        status[rank] = 1
        while (status == 0).any():
            if (status == 3).any():
                raise RuntimeError("a peer failed before the first call")
        for i, (n, k) in enumerate(GEMV_CALLS):
            xs, ws, bias, residual, weight = gemv_case(n, k, world, dtype, seed=200 + i)
            out, res = gemv_all_reduce_add_rms_norm(
                xs[rank], ws[rank], bias if rank == 0 else None, residual, weight, EPS, counters[i % 2], peers
            )
            assert res is residual, "the residual must be updated in place"
            outs[i].copy_(out)
            ress[i].copy_(res)
            assert peers.error.item() == 0, f"call {i}: a wait ran out of spins"
            assert all(int(c.item()) == 0 for c in counters), f"call {i}: a counter was not re-armed"
        calls[rank] = int(peers.call.item())
        status[rank] = 2
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        status[rank] = 3
