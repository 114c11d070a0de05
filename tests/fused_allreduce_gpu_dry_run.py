"""A CPU dry run of tests/gpu/test_fused_allreduce_gpu.py's checks, to catch mistakes in
the test itself before spending GPU time on it (not collected by pytest; seconds):

    python tests/fused_allreduce_gpu_dry_run.py

Two processes with gloo instead of NCCL; the fused kernel through Triton's interpreter on
shared-memory buffers instead of symmetric memory (as tests/fused_allreduce_checks.py
does); gloo's all-reduce for the unfused path; CUDA synchronisation, sleeps, events and
graph capture stubbed (a "captured" function runs at each replay); sizes shrunk.
"""

from __future__ import annotations

import os
import sys
import traceback
from dataclasses import replace
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported, here and in the children

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

WORLD, MAX_PROGRAMS, SLOT = 2, 3, 8 * 256


def _worker(rank: int, port: int, buffers, results) -> None:
    try:
        import torch.distributed as dist

        import agent_infer.tp_layers.symm_mem as sm
        import tests.gpu.test_fused_allreduce_gpu as t
        from agent_infer.kernels.triton.allreduce_norm import PeerBuffers, all_reduce_add_rms_norm, fits
        from tests.kernel_checks import patch_interpreter_scalar_index

        patch_interpreter_scalar_index()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)

        class SharedMemoryFused:
            def __init__(self, group, device, dtype, max_bytes, max_spins):
                self.buffer = buffers[rank]
                self.peers = PeerBuffers(
                    torch.tensor([b.data_ptr() for b in buffers]),
                    torch.zeros(MAX_PROGRAMS, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                    rank, WORLD, SLOT, MAX_PROGRAMS, max_spins,
                )

            def accepts(self, x, residual):
                return fits(x, residual, self.peers)

            def __call__(self, x, residual, weight, eps, add=True):
                return all_reduce_add_rms_norm(x, residual, weight, eps, self.peers, add)

            def with_spin_limit(self, n):
                self.peers = replace(self.peers, max_spins=n)

        class GlooAllReduce:
            def __init__(self, group, device, dtype):
                self.group = group

            def __call__(self, x):
                dist.all_reduce(x, group=self.group)

        class Event:
            def __init__(self, **kwargs):
                pass

            def record(self):
                pass

            def elapsed_time(self, other):
                return 0.0

        sm.SymmMemAllReduceNorm, sm.SymmMemAllReduce = SharedMemoryFused, GlooAllReduce
        torch.cuda.synchronize = lambda *a, **k: None
        torch.cuda._sleep = lambda cycles: None
        torch.cuda.Event = Event
        t._capture = lambda fn: fn
        t.SIZES = [(1, 96), (3, 200), (5, 96)]
        t.NO_ADD_SIZES = [(1, 96), (4, 200)]
        t.HIDDEN, t.BETWEEN = 96, (5, 200)
        t.BACK_TO_BACK_ROWS = [1, 3, 5, 2, 7]
        t.N_CALLS, t.N_REPLAYS, t.GRAPH_ROWS, t.BENCH_CALLS = 12, 4, (1, 3), 3
        t.SPIN_LIMIT, t.WARMUP_SPIN_LIMIT = 20_000, 200_000
        report = t._checks(rank, torch.device("cpu"), dist.group.WORLD)
        results.put((rank, "ok", "\n".join(report)))
    except BaseException:
        results.put((rank, "failed", traceback.format_exc()))
    finally:
        results.close()
        results.join_thread()
        os._exit(0)


def main() -> int:
    from agent_infer.tp_layers.group import free_port

    from agent_infer.kernels.triton.allreduce_norm import fill_not_arrived

    buffers = [fill_not_arrived(torch.empty(2 * WORLD * SLOT, dtype=torch.bfloat16)).share_memory_() for _ in range(WORLD)]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, buffers, results)) for r in range(WORLD)]
    for p in procs:
        p.start()
    ok = True
    for _ in range(WORLD):
        rank, status, text = results.get(timeout=900)
        print(f"rank {rank}: {status}\n{text}")
        ok &= status == "ok"
    for p in procs:
        p.join(10)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
