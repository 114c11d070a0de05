"""Start the engine of this process's rank.

In one process, or on rank 0, that is an `LLMEngine` (which starts its own worker
processes for `tensor_parallel_size > 1`). Under `torchrun` every process runs the
caller's script, so ranks > 0 serve rank 0's engine here instead and the process ends
with it: `launch_engine` does not return on those ranks.
"""

from __future__ import annotations

import sys
from dataclasses import replace

from agent_infer.config import ConfigError, EngineConfig
from agent_infer.distributed.group import torchrun_launch
from agent_infer.engine.llm_engine import LLMEngine


def launch_engine(config: EngineConfig, detokenize: bool = True) -> LLMEngine:
    launch = torchrun_launch()
    if launch is not None and launch.rank != 0:
        from agent_infer.engine.worker import worker_main

        if config.tensor_parallel_size not in (1, launch.world_size):
            raise ConfigError(f"--tp {config.tensor_parallel_size} but torchrun started {launch.world_size} processes")
        sys.exit(worker_main(replace(config, tensor_parallel_size=launch.world_size), launch))
    return LLMEngine(config, detokenize=detokenize)
