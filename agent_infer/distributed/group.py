"""Creating and tearing down the tensor-parallel process group.

Two ways in: the engine spawns its own workers on one machine (rank 0 picks a free
port), or the job was started by `torchrun` (RANK, WORLD_SIZE, MASTER_ADDR, ... set),
which also works across machines. A world of one never creates a group.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from agent_infer.distributed.state import ParallelState

log = logging.getLogger(__name__)

# NVLink multicast stays off wherever we start processes (it can take a shared host's GPUs down).
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def apply_safe_env() -> None:
    for k, v in SAFE_ENV.items():
        os.environ.setdefault(k, v)


@dataclass(frozen=True)
class LaunchInfo:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    external: bool  # started by torchrun rather than by the engine


def torchrun_launch() -> LaunchInfo | None:
    """The torchrun environment of this process, if any (WORLD_SIZE > 1)."""
    env = os.environ
    if "RANK" not in env or "WORLD_SIZE" not in env or int(env["WORLD_SIZE"]) <= 1:
        return None
    return LaunchInfo(
        rank=int(env["RANK"]),
        world_size=int(env["WORLD_SIZE"]),
        local_rank=int(env.get("LOCAL_RANK", env["RANK"])),
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=int(env.get("MASTER_PORT", "29500")),
        external=True,
    )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def init_group(info: LaunchInfo, device: torch.device, timeout_s: float = 60.0) -> ParallelState:
    """Join the group (blocks until every rank has). NCCL on CUDA, gloo on CPU. The timeout
    bounds how long a collective waits for a rank that went away."""
    apply_safe_env()
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed process group already exists in this process; one TP engine per process")
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {}
    if device.type == "cuda":
        kwargs["device_id"] = device
    # Under torchrun, env:// joins the launcher's own store (MASTER_PORT may be 0 there).
    init_method = "env://" if info.external else f"tcp://{info.master_addr}:{info.master_port}"
    dist.init_process_group(
        backend=backend,
        init_method=init_method,
        rank=info.rank,
        world_size=info.world_size,
        timeout=timedelta(seconds=timeout_s),
        **kwargs,
    )
    # No reference to the group object (`group=None`: the default group): only torch holds
    # it, so `destroy_group` ends it for real (see there), however long the model lives.
    return ParallelState(rank=info.rank, world_size=info.world_size)


def store() -> dist.Store:
    """The key-value store the group was formed with (used to publish the control address)."""
    return dist.distributed_c10d._get_default_store()


def destroy_group(timeout_s: float = 10.0) -> None:
    """Destroy the group, and with it gloo's worker threads, before the interpreter exits.

    Those threads release each finished collective's tensors, which takes the GIL. Once the
    interpreter finalizes, Python ends a thread that asks for the GIL, and ending one inside
    that destructor aborts the process ("terminate called without an active exception"):
    a thread late to release the last step's tensors did so at exit on a loaded host. The
    threads stop only when the group's last reference goes; `destroy_process_group` drops
    torch's and `init_group` keeps none of ours, so they are joined here.

    Without risking a hang: destroying after symmetric-memory use was seen to block, so it
    runs in a daemon thread that is abandoned after `timeout_s`."""
    if not dist.is_initialized():
        return
    t = threading.Thread(target=_destroy_quietly, daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        log.warning("destroy_process_group did not return within %.0f s; leaving it", timeout_s)


def _destroy_quietly() -> None:
    try:
        dist.destroy_process_group()
    except Exception as e:  # the group may already be broken by a dead peer
        log.debug("destroy_process_group: %s", e)
