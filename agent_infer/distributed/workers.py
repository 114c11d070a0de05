"""Tensor-parallel workers: ranks 1..N-1 run the same forward passes as rank 0.

Rank 0 owns the tokenizer, scheduler and sampler. Each step it sends the step's host
arrays (`HostStep`) over the control channel to every worker; all ranks run the forward
pass together (their collectives meet inside it) and only rank 0 samples.

With async scheduling rank 0 launches step N+1 before step N's tokens reach its host, so
some of step N+1's input ids are placeholders (`HostStep.prev_index`): "the token step N
sampled in row i", which exists only on the devices. So after sampling, rank 0
broadcasts the sampled tokens to every rank on the device (no host sync), and each
worker, after its forward pass, joins that broadcast into the buffer its next step's
placeholders read (`ModelRunner.follow`). Every rank therefore feeds the same input ids
at the same positions and writes the same tokens into the same cache slots — the KV
caches stay in step by construction. All ranks issue the collectives in one order: the
forward pass's all-reduces, then the token broadcast, which all skip when the step
samples nothing (a chunk of a prompt), as each knows the count from the `HostStep`.
Synchronous stepping runs the same protocol (its steps just carry no placeholders).

If a rank fails mid-step the others block in a collective that will never complete; the
control channel (acks, error reports, closed sockets) is how rank 0 finds out, and the
failed engine then kills its local workers rather than waiting for an orderly exit.

This module is rank 0's side of the processes and the channel; what a worker runs is the
engine's (`agent_infer.engine.worker`), started here by module name.
"""

from __future__ import annotations

import ctypes
import logging
import os
import pickle
import signal
import subprocess
import sys
import time
from dataclasses import replace

import torch

from agent_infer.config import EngineConfig
from agent_infer.distributed.control import ControlServer, WorkerError, exit_now
from agent_infer.distributed.group import LaunchInfo, destroy_group, free_port, init_group, store

log = logging.getLogger(__name__)

CONTROL_KEY = "agent_infer/control_address"  # where rank 0 publishes the channel, in the group's store


def rank_device(config: EngineConfig, local_rank: int) -> torch.device:
    base = config.resolve_device()
    if base.type == "cuda":
        return torch.device("cuda", local_rank)
    return base


def die_with_parent() -> None:
    """Linux: get SIGKILL when the parent dies, so a crashed engine leaves no orphans."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class WorkerGroup:
    """Rank 0's side: starts local workers (unless torchrun did), joins the group, and
    drives the workers over the control channel."""

    def __init__(self, config: EngineConfig, info: LaunchInfo, device: torch.device, entry: str):
        """`entry`: the module a local worker runs (`python -m entry`, its spec pickled on
        stdin as (config, launch info, parent pid))."""
        self.info = info
        self.procs: list[subprocess.Popen] = []
        if not info.external:
            # Fresh interpreters (not multiprocessing's spawn), so the caller's __main__
            # is never re-imported in a worker.
            for rank in range(1, info.world_size):
                spec = pickle.dumps((config, replace(info, rank=rank, local_rank=rank), os.getpid()))
                p = subprocess.Popen([sys.executable, "-m", entry], stdin=subprocess.PIPE)
                p.stdin.write(spec)
                p.stdin.close()
                self.procs.append(p)
        try:
            self.tp = init_group(info, device)
            host = info.master_addr if info.external else "127.0.0.1"
            self.control = ControlServer(host, info.world_size - 1)
            store().set(CONTROL_KEY, self.control.address)
            self.control.accept_all(timeout_s=600, alive=self._dead_worker)
            self.control.start_watch(on_fatal=lambda msg: exit_now(msg, self.kill))
        except BaseException:
            self.kill()
            raise
        self.step_no = 0

    def _dead_worker(self) -> str | None:
        for rank, p in enumerate(self.procs, start=1):
            if p.poll() is not None:
                return f"tensor-parallel worker {rank} exited with code {p.returncode} during start-up"
        return None

    def send_step(self, step) -> None:
        self.control.check()
        self.step_no += 1
        self.control.broadcast(("step", self.step_no, step))

    def check(self) -> None:
        self.control.check()

    def failure(self, wait_s: float = 0.0) -> str | None:
        """The worker failure the control channel recorded, if any. A collective that raised
        on rank 0 usually means a worker just died; its socket closed at the same moment,
        so the reader thread gets up to `wait_s` to record that."""
        deadline = time.monotonic() + wait_s
        while self.control.failure is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.control.failure

    def shutdown(self, timeout_s: float = 10.0) -> None:
        if getattr(self, "control", None) is not None:
            self.control.closing = True  # workers leaving now is expected, not a failure
            try:
                self.control.broadcast(("shutdown",))
            except WorkerError:
                pass
            self.control.wait_disconnected(timeout_s)
            self.control.close()
        for p in self.procs:
            try:
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        self.kill()
        destroy_group()

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)


def local_launch(world_size: int) -> LaunchInfo:
    return LaunchInfo(rank=0, world_size=world_size, local_rank=0, master_addr="127.0.0.1",
                      master_port=free_port(), external=False)
