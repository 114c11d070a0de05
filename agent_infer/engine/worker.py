"""A tensor-parallel worker rank: build this rank's shard of the model, then run the steps
rank 0 sends until told to stop (or rank 0 goes away). The protocol is described in
`agent_infer.distributed.workers`; `python -m agent_infer.engine.worker` is the entry of a
worker the engine started itself."""

from __future__ import annotations

import logging
import os
import pickle
import sys
import traceback

import torch

from agent_infer.config import EngineConfig, ModelConfig
from agent_infer.distributed.control import ControlClient
from agent_infer.distributed.group import LaunchInfo, apply_safe_env, destroy_group, init_group, store
from agent_infer.distributed.workers import CONTROL_KEY, die_with_parent, rank_device
from agent_infer.engine.runner_setup import setup_runner

log = logging.getLogger(__name__)


def worker_main(config: EngineConfig, info: LaunchInfo) -> int:
    """Serve rank `info.rank` of rank 0's engine; returns the process's exit code."""
    apply_safe_env()
    logging.basicConfig(level=logging.WARNING)
    device = rank_device(config, info.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // info.world_size))
    client = None
    try:
        tp = init_group(info, device)
        client = ControlClient(store().get(CONTROL_KEY).decode(), info.rank)
        model_config = ModelConfig.from_hf(config.model, config.model_impl)
        dtype = config.resolve_dtype(device)
        runner, _ = setup_runner(config, model_config, device, dtype, tp)
        while True:
            msg = client.recv()
            if msg is None or msg[0] == "shutdown":
                break
            if msg[0] == "step":
                runner.follow(msg[2])
                client.send(("ack", msg[1]))
        return 0
    except Exception as e:
        detail = f"{type(e).__name__}: {e}"
        log.error("worker %d failed:\n%s", info.rank, traceback.format_exc())
        if client is not None:
            try:
                client.send(("error", detail))
            except OSError:
                pass
        return 1
    finally:
        destroy_group()
        if client is not None:
            client.close()


def _main() -> None:
    """Entry of a locally started worker: its spec arrives pickled on stdin."""
    config, info, parent_pid = pickle.load(sys.stdin.buffer)
    die_with_parent()
    if os.getppid() != parent_pid:
        sys.exit(1)  # the parent died before the death signal was set
    sys.exit(worker_main(config, info))


if __name__ == "__main__":
    _main()
