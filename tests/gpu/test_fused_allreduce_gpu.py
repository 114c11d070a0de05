"""The fused all-reduce + residual add + RMSNorm kernel on 2 GPUs (NCCL group, PyTorch
symmetric memory), in two worker processes:

- every (rows, hidden) in {1, 3, 64, 256} x {4096, 5120} against NCCL's all-reduce + the
  reference add + norm (bf16 tolerances), and against the unfused symmetric-memory path
  (one-shot all-reduce + the Triton add + norm; counted, expected bit-equal at 2 ranks);
  both ranks bit-identical; the same without the add (the embedding's case) for a few;
- 200 calls back to back without a sync (row counts changing, one rank now and then
  delayed by a sleep kernel): every result checked afterwards (the not-arrived marks restored, the double
  buffer);
- the same inside a CUDA graph: a captured chain of three calls replayed 50 times with new
  inputs, eager calls of other sizes in between;
- the buffer ends all not-arrived (-0.0) and no wait ran out of spins (bounded here: a protocol bug fails
  in seconds instead of hanging the GPU);
- a micro-benchmark (printed, not asserted): 72 fused calls against 72 x (one-shot
  all-reduce + add + norm), each captured in a graph, rows = 1, hidden = 4096.

Run: python -m pytest -q -s tests/gpu/test_fused_allreduce_gpu.py
"""

from __future__ import annotations

import json
import os
import random
import traceback
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")

WORLD = 2
SIZES = [(m, h) for m in (1, 3, 64, 256) for h in (4096, 5120)]
NO_ADD_SIZES = [(1, 4096), (3, 5120), (64, 4096)]
HIDDEN = 4096  # of the back-to-back, graph and benchmark sections
BACK_TO_BACK_ROWS = [1, 3, 64, 7, 256, 1, 1, 2, 130, 5]  # > 132 programs: rows loop on the cap
N_CALLS, N_REPLAYS, GRAPH_ROWS, BENCH_CALLS = 200, 50, (1, 64), 72
BETWEEN = (5, 5120)  # the eager calls between graph replays
SPIN_LIMIT = 1 << 22  # seconds of spinning per wait
WARMUP_SPIN_LIMIT = 1 << 26  # while the ranks compile the kernel variants (not in step)
TIMEOUT_S = 240


def test_fused_all_reduce_norm_two_gpus(tmp_path):
    import torch.multiprocessing as mp

    from agent_infer.distributed.group import SAFE_ENV, free_port
    from tests.fused_allreduce_checks import run_processes

    os.environ.update(SAFE_ENV)  # inherited by the workers (they set it again first thing)
    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, port, str(tmp_path))) for r in range(WORLD)]
    hung = run_processes(procs, TIMEOUT_S)
    results = {}
    for r in range(WORLD):
        f = Path(tmp_path) / f"rank{r}.json"
        results[r] = json.loads(f.read_text()) if f.exists() else {"error": f"rank {r} wrote nothing"}
    errors = [f"rank {r}: {res['error']}" for r, res in results.items() if "error" in res]
    assert not hung and not errors, f"hung ranks {hung}\n" + "\n".join(errors)
    for line in results[0]["report"]:
        print(line)


def _worker(rank: int, port: int, out_dir: str) -> None:
    from agent_infer.distributed.group import SAFE_ENV

    os.environ.update(SAFE_ENV)
    out = Path(out_dir) / f"rank{rank}.json"
    try:
        import torch.distributed as dist

        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                                device_id=device)
        report = _checks(rank, device, dist.group.WORLD)
        out.write_text(json.dumps({"report": report}))
    except BaseException:
        out.write_text(json.dumps({"error": traceback.format_exc()}))
    finally:
        os._exit(0)  # no process-group teardown after symmetric-memory use (it can hang)


def _checks(rank: int, device: torch.device, group) -> list[str]:
    import torch.distributed as dist

    from agent_infer.kernels import reference
    from agent_infer.kernels.triton import norm as triton_norm
    from agent_infer.distributed.symm_mem import SymmMemAllReduce, SymmMemAllReduceNorm
    from tests.fused_allreduce_checks import EPS, case_inputs, expected
    from tests.kernel_checks import assert_close

    dtype = torch.bfloat16
    fused = SymmMemAllReduceNorm(group, device, dtype, max_bytes=4 << 20, max_spins=WARMUP_SPIN_LIMIT)
    unfused_ar = SymmMemAllReduce(group, device, dtype)
    report = [f"programs at most {fused.peers.max_programs}; slot {fused.peers.slot_numel} elements"]

    def on_device(m, h, seed):
        ys, residual, weight = case_inputs(m, h, WORLD, dtype, seed)
        return [y.to(device) for y in ys], residual.to(device), weight.to(device)

    # Compile every variant first (Triton specialises on row counts of 1, ...): a rank still
    # compiling keeps the other waiting in the kernel.
    for m, h in SIZES + [(m, HIDDEN) for m in BACK_TO_BACK_ROWS + list(GRAPH_ROWS)] + [BETWEEN]:
        ys, residual, weight = on_device(m, h, seed=1)
        fused(ys[rank].clone(), residual, weight, EPS)
    for m, h in NO_ADD_SIZES:
        ys, residual, weight = on_device(m, h, seed=1)
        fused(ys[rank].clone(), residual, weight, EPS, add=False)
    torch.cuda.synchronize(device)
    fused.with_spin_limit(SPIN_LIMIT)

    def same_on_every_rank(t: torch.Tensor, what: str) -> None:
        parts = [torch.empty_like(t) for _ in range(WORLD)]
        dist.all_gather(parts, t.contiguous(), group=group)
        assert all(torch.equal(p, parts[0]) for p in parts), f"{what}: ranks differ"

    def check_fused_error(what: str) -> None:
        torch.cuda.synchronize(device)
        assert fused.peers.error.item() == 0, f"{what}: a wait for a peer's rows ran out of spins"

    # ---- sizes, against NCCL + reference and against the unfused symmetric-memory path ----
    unequal = []
    for i, (m, h) in enumerate(SIZES):
        ys, residual, weight = on_device(m, h, seed=10 + i)
        ref_out, ref_res = expected(ys, residual, weight)
        nccl = ys[rank].clone()
        dist.all_reduce(nccl, group=group)
        nccl_out, nccl_res = reference.fused_add_rms_norm(nccl, residual.clone(), weight, EPS)
        x, r = ys[rank].clone(), residual.clone()
        assert fused.accepts(x, r)
        out, res = fused(x, r, weight, EPS)
        assert out is x and res is r
        u_x, u_r = ys[rank].clone(), residual.clone()
        unfused_ar(u_x)
        u_out, u_res = triton_norm.fused_add_rms_norm(u_x, u_r, weight, EPS)
        check_fused_error(f"{m}x{h}")
        for got, want, what in ((res, ref_res, "residual"), (out, ref_out, "output")):
            assert_close(got, want, f"{m}x{h} {what} vs fp32-sum reference")
        assert_close(res, nccl_res, f"{m}x{h} residual vs NCCL")
        assert_close(out, nccl_out, f"{m}x{h} output vs NCCL")
        same_on_every_rank(out, f"{m}x{h} output")
        same_on_every_rank(res, f"{m}x{h} residual")
        n_diff = int((out != u_out).sum()) + int((res != u_res).sum())
        if n_diff:
            unequal.append(f"{m}x{h}: {n_diff} elements")
    report.append("fused vs unfused symmetric-memory path, bit-unequal elements: " + (", ".join(unequal) or "none"))

    # ---- no add (the embedding's sum and the first layer's norm): residual <- the sum ----
    unequal = []
    for i, (m, h) in enumerate(NO_ADD_SIZES):
        ys, _, weight = on_device(m, h, seed=50 + i)
        ref_out, ref_sum = expected(ys, None, weight, add=False)
        x, summed = ys[rank].clone(), torch.empty_like(ys[rank])
        out, res = fused(x, summed, weight, EPS, add=False)
        assert out is x and res is summed
        u_x = ys[rank].clone()
        unfused_ar(u_x)
        u_out = triton_norm.rms_norm(u_x, weight, EPS)
        check_fused_error(f"{m}x{h} no add")
        assert_close(res, ref_sum, f"{m}x{h} no-add sum vs fp32-sum reference")
        assert_close(out, ref_out, f"{m}x{h} no-add output vs fp32-sum reference")
        same_on_every_rank(out, f"{m}x{h} no-add output")
        n_diff = int((out != u_out).sum()) + int((res != u_x).sum())
        if n_diff:
            unequal.append(f"{m}x{h}: {n_diff} elements")
    report.append("no add, fused vs one-shot + rms_norm, bit-unequal elements: " + (", ".join(unequal) or "none"))

    # ---- back to back, no sync, changing row counts, one rank now and then late ----
    rng = random.Random(5)  # same sequence on both ranks (only who sleeps differs)
    calls = []
    for i in range(N_CALLS):
        m = BACK_TO_BACK_ROWS[i % len(BACK_TO_BACK_ROWS)]
        ys, residual, weight = on_device(m, HIDDEN, seed=1000 + i)
        calls.append((ys, residual, weight))
    results = []
    for i, (ys, residual, weight) in enumerate(calls):
        if rng.random() < 0.1 and rng.randrange(WORLD) == rank:
            torch.cuda._sleep(rng.randrange(1000, 200_000))  # cycles: this rank arrives late
        x, r = ys[rank].clone(), residual.clone()
        fused(x, r, weight, EPS)
        results.append((x.clone(), r.clone()))
    check_fused_error("back to back")
    for i, ((ys, residual, weight), (out, res)) in enumerate(zip(calls, results)):
        ref_out, ref_res = expected(ys, residual, weight)
        assert_close(res, ref_res, f"back-to-back call {i} residual")
        assert_close(out, ref_out, f"back-to-back call {i} output")
        same_on_every_rank(out, f"back-to-back call {i}")
    report.append(f"{N_CALLS} back-to-back calls: ok")

    # ---- CUDA graph: a chain of three calls, replayed with new inputs ----
    for m in GRAPH_ROWS:
        h = HIDDEN
        xs = [torch.empty(m, h, device=device, dtype=dtype) for _ in range(3)]
        res_s = torch.empty(m, h, device=device, dtype=dtype)
        w_s = torch.empty(h, device=device, dtype=dtype)

        def chain():
            fused(xs[0], res_s, w_s, EPS)
            fused(xs[1], res_s, w_s, EPS)
            fused(xs[2], res_s, w_s, EPS)

        def load(seed):
            ys3 = []
            for k in range(3):
                ys, residual, weight = on_device(m, h, seed=seed * 3 + k)
                ys3.append(ys)
                if k == 0:
                    r0, w = residual, weight  # one residual chain, one weight
            for k in range(3):
                xs[k].copy_(ys3[k][rank])
            res_s.copy_(r0)
            w_s.copy_(w)
            return ys3, r0, w

        def want(ys3, r0, w):
            r = r0.clone()
            outs = []
            for k in range(3):
                o, r = expected(ys3[k], r, w)
                outs.append(o)
            return outs, r

        load(0)
        chain()  # compile, outside the capture
        torch.cuda.synchronize(device)
        dist.barrier(group=group)
        replay = _capture(chain)
        got, inputs = [], []
        for rep in range(N_REPLAYS):
            inputs.append(load(100 + rep))
            replay()
            got.append(([x.clone() for x in xs], res_s.clone()))
            if rep % 7 == 3:  # eager calls of another size between replays
                ys, residual, weight = on_device(*BETWEEN, seed=7000 + rep)
                fused(ys[rank].clone(), residual, weight, EPS)
        check_fused_error(f"graph m={m}")
        for rep, ((ys3, r0, w), (outs, res)) in enumerate(zip(inputs, got)):
            want_outs, want_res = want(ys3, r0, w)
            assert_close(res, want_res, f"graph m={m} replay {rep} residual")
            for k in range(3):
                assert_close(outs[k], want_outs[k], f"graph m={m} replay {rep} call {k} output")
            same_on_every_rank(res, f"graph m={m} replay {rep}")
        del replay
    report.append(f"CUDA graph (m = {GRAPH_ROWS}), {N_REPLAYS} replays of a 3-call chain: ok")

    torch.cuda.synchronize(device)
    from agent_infer.kernels.triton.allreduce_norm import fill_not_arrived

    clean = fill_not_arrived(torch.empty_like(fused.buffer))
    assert torch.equal(fused.buffer.view(torch.int16), clean.view(torch.int16)), "buffer not back to all not-arrived"
    report.append("buffer back to all not-arrived; no wait ran out of spins")

    # ---- micro-benchmark: 72 fused calls vs 72 x (one-shot all-reduce + add + norm) ----
    m, h, n = 1, HIDDEN, BENCH_CALLS
    ys, residual, weight = on_device(m, h, seed=99)
    xs = [ys[rank].clone() for _ in range(n)]
    r = residual.clone()

    def run_fused():
        for x in xs:
            fused(x, r, weight, EPS)

    def run_unfused():
        for x in xs:
            unfused_ar(x)
            triton_norm.fused_add_rms_norm(x, r, weight, EPS)

    for name, fn in (("fused", run_fused), ("unfused", run_unfused)):
        fn()
        torch.cuda.synchronize(device)
        dist.barrier(group=group)
        replay = _capture(fn)
        for _ in range(3):
            replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            replay()
        end.record()
        torch.cuda.synchronize(device)
        report.append(f"{name}: {start.elapsed_time(end) * 1000 / (20 * n):.2f} us per norm ({n} in a graph)")
        del replay
    check_fused_error("benchmark")
    return report


def _capture(fn):
    """fn captured in a CUDA graph (not run); returns the graph's replay."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay
