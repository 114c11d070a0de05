"""Checks of the fused all-reduce + residual add + RMSNorm kernel
(`agent_infer/kernels/triton/allreduce_norm.py`), shared by the CPU test (two processes
running the kernel through Triton's interpreter on shared-memory buffers, see
`run_interpreter_ranks`) and tests/gpu/test_fused_allreduce_gpu.py (two GPUs, PyTorch
symmetric memory).

The reference is the unfused path: the all-reduce (fp32 sum in rank order, rounded to
the activation dtype), then `reference.fused_add_rms_norm`. Inputs are random, never
zeros, and differ per rank and per call, so a stale or wrong buffer half, a row read
from the wrong peer or a row read before it arrived changes the result. A few elements of
every y are signed zeros: -0.0 is the kernel's not-arrived mark, which no rank may send.
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
    for r, y in enumerate(ys):
        y.view(-1)[r::7] = -0.0
        y.view(-1)[r + 3::11] = 0.0
    residual = (torch.randn(m, h, generator=g) * 2 + 0.05).to(dtype)
    weight = (torch.rand(h, generator=g) + 0.5).to(dtype)
    return ys, residual, weight


def expected(
    ys: list[torch.Tensor], residual: torch.Tensor | None, weight: torch.Tensor, eps: float = EPS, add: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, new residual) of all_reduce_sum(y) followed by fused_add_rms_norm, or with
    add=False by rms_norm (the new residual is then the sum)."""
    s = torch.zeros(ys[0].shape, dtype=torch.float32, device=ys[0].device)
    for y in ys:
        s += y.float()
    s = s.to(ys[0].dtype)
    if not add:
        return reference.rms_norm(s, weight, eps), s
    return reference.fused_add_rms_norm(s, residual.clone(), weight, eps)


def run_processes(procs: list, timeout_s: float) -> list[int]:
    """Start the processes, wait for all of them up to `timeout_s` in total, kill those
    still running; returns their indices (the hung ones)."""
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
    return hung


# ---- CPU: two processes through Triton's interpreter --------------------------------------

# (rows, cols) of the calls each rank makes back to back, in this order: different row
# counts change the grid (and, past max_programs, make programs loop over rows).
INTERPRETER_CALLS = [(3, 200), (1, 200), (5, 200), (5, 200), (2, 96), (7, 200), (1, 96), (4, 200)]
INTERPRETER_NO_ADD = (1, 5)  # the calls made with add=False (residual <- the sum)
INTERPRETER_MAX_PROGRAMS = 3


def run_interpreter_ranks(dtype: torch.dtype, world: int = 2, timeout_s: float = 600.0, first_call: int = 0) -> None:
    """Run INTERPRETER_CALLS on `world` processes (the caller's environment must have
    TRITON_INTERPRET=1, which the children inherit) and check every call on every rank
    against the reference, and the ranks against each other bit for bit."""
    import torch.multiprocessing as mp

    from agent_infer.kernels.triton.allreduce_norm import fill_not_arrived

    slot = max(m * h for m, h in INTERPRETER_CALLS)
    numel = 2 * world * slot
    # Each buffer sits between two guards as large as itself: a write at a wrong (e.g.
    # negative) half lands in a guard instead of passing unseen.
    arenas = [torch.full((3 * numel,), 7.0, dtype=dtype).share_memory_() for _ in range(world)]
    for a in arenas:
        fill_not_arrived(a[numel:2 * numel])
    outs = [[torch.zeros(m, h, dtype=dtype).share_memory_() for m, h in INTERPRETER_CALLS] for _ in range(world)]
    ress = [[torch.zeros(m, h, dtype=dtype).share_memory_() for m, h in INTERPRETER_CALLS] for _ in range(world)]
    epochs = torch.zeros(world, INTERPRETER_MAX_PROGRAMS, dtype=torch.int32).share_memory_()
    status = torch.zeros(world, dtype=torch.int32).share_memory_()  # 1 = ready, 2 = done, 3 = failed
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    procs = [
        ctx.Process(
            target=_interpreter_rank,
            args=(r, world, dtype, arenas, slot, outs[r], ress[r], epochs[r], status, errors, first_call),
        )
        for r in range(world)
    ]
    hung = run_processes(procs, timeout_s)
    messages = []
    while not errors.empty():
        messages.append(errors.get())
    assert not hung, f"ranks {hung} still running after {timeout_s} s (a wait that never ends?)"
    assert status.tolist() == [2] * world, f"rank status {status.tolist()}:\n" + "\n".join(messages)
    for i, (m, h) in enumerate(INTERPRETER_CALLS):
        ys, residual, weight = case_inputs(m, h, world, dtype, seed=100 + i)
        ref_out, ref_res = expected(ys, residual, weight, add=i not in INTERPRETER_NO_ADD)
        for r in range(world):
            assert torch.equal(outs[r][i], outs[0][i]) and torch.equal(ress[r][i], ress[0][i]), (
                f"call {i} ({m}x{h}): rank {r} differs from rank 0"
            )
        from tests.kernel_checks import assert_close

        assert_close(ress[0][i], ref_res, f"call {i} ({m}x{h}) residual")
        assert_close(outs[0][i], ref_out, f"call {i} ({m}x{h}) output")
    not_arrived = fill_not_arrived(torch.empty(numel, dtype=dtype))
    calls = len(INTERPRETER_CALLS)
    for r, a in enumerate(arenas):
        assert (a[:numel] == 7.0).all() and (a[2 * numel:] == 7.0).all(), f"rank {r}: a write outside the buffer"
        # Every row that arrived was read and marked not-arrived again: ready for reuse.
        assert torch.equal(a[numel:2 * numel].view(torch.int8), not_arrived.view(torch.int8)), (
            f"rank {r}: buffer not back to all not-arrived"
        )
        # Every program slot counted every call.
        assert epochs[r].tolist() == [_int32(first_call + calls)] * INTERPRETER_MAX_PROGRAMS, (
            f"rank {r}: call counts {epochs[r].tolist()}"
        )


def _int32(n: int) -> int:
    """n as the kernel's int32 call count holds it (wrapping)."""
    return (n + 2**31) % 2**32 - 2**31


def _interpreter_rank(rank, world, dtype, arenas, slot, outs, ress, epochs, status, errors, first_call) -> None:
    try:
        from tests.kernel_checks import patch_interpreter_scalar_index

        patch_interpreter_scalar_index()
        from agent_infer.kernels.triton.allreduce_norm import PeerBuffers, all_reduce_add_rms_norm

        # Each process maps the shared buffers at its own addresses, as symmetric memory
        # does; a buffer starts one buffer length into its arena (past the front guard).
        numel = 2 * world * slot
        peers = PeerBuffers(
            buffer_ptrs=torch.tensor([a[numel:].data_ptr() for a in arenas], dtype=torch.int64),
            epochs=torch.full((INTERPRETER_MAX_PROGRAMS,), _int32(first_call), dtype=torch.int32),
            error=torch.zeros(1, dtype=torch.int32),
            rank=rank,
            world_size=world,
            slot_numel=slot,
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
            out, res = all_reduce_add_rms_norm(x, residual, weight, EPS, peers, add=i not in INTERPRETER_NO_ADD)
            assert out is x and res is residual, "the fused op must work in place and return its inputs"
            outs[i].copy_(out)
            ress[i].copy_(res)
            assert peers.error.item() == 0, f"call {i}: a wait for a peer's rows ran out of spins"
        epochs.copy_(peers.epochs)
        status[rank] = 2
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        status[rank] = 3
