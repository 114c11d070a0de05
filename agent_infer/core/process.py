"""Starting the engine core in a process of its own, and that process's entry point.

The core runs in a fresh interpreter (`python -m agent_infer.core`), not one
forked or spawned by multiprocessing, so nothing of the parent's `__main__` is imported
into it; its spec arrives pickled on stdin and it answers on a status pipe with its
`CoreInfo` once the engine is built (or with the one-line reason it could not be). Its
socket lives in a private temporary directory, so two servers never meet.

The mechanism is `agent_infer.core.spawn`'s, which the server's supervisor also starts its
front ends with.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

from agent_infer.config import ConfigError, EngineConfig
from agent_infer.core.config import CoreConfig
from agent_infer.core.engine_core import EngineCore
from agent_infer.core.protocol import CoreInfo
from agent_infer.core.spawn import LOG_FORMAT, ChildFailed, kill, read_spec, report_status, start_child, wait_status
from agent_infer.core.watch import signal_on_parent_death

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CoreSpec:
    engine_config: EngineConfig
    core_config: CoreConfig
    address: str
    parent_pid: int
    log_level: str = "info"
    # (EngineConfig) -> LLMEngine, picklable by reference; None: the engine without text.
    engine_factory: Callable | None = None


# ---- the core -----------------------------------------------------------------------------------


class CoreProcess:
    """The engine core as a child process: started, watched, stopped."""

    def __init__(self, proc: subprocess.Popen, info: CoreInfo, address: str, ipc_dir: str):
        self.proc = proc
        self.info = info
        self.address = address
        self._ipc_dir = ipc_dir

    @classmethod
    def start(cls, engine_config: EngineConfig, core_config: CoreConfig | None = None, *,
              engine_factory: Callable | None = None, log_level: str = "info",
              timeout_s: float | None = None) -> "CoreProcess":
        """Start the core and wait until its engine is built. A configuration it cannot run
        is a ConfigError with the core's one-line reason."""
        ipc_dir = tempfile.mkdtemp(prefix="agent-infer-")
        address = f"ipc://{ipc_dir}/core"
        spec = CoreSpec(engine_config, core_config or CoreConfig(), address, os.getpid(), log_level, engine_factory)
        proc, status = start_child("agent_infer.core", spec)
        try:
            info = wait_status(proc, status, "engine core", timeout_s)
        except ChildFailed as e:
            kill([proc])
            shutil.rmtree(ipc_dir, ignore_errors=True)
            raise ConfigError(str(e)) from None
        except BaseException:  # e.g. Ctrl-C while the model loads
            kill([proc])
            shutil.rmtree(ipc_dir, ignore_errors=True)
            raise
        return cls(proc, info, address, ipc_dir)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, then SIGKILL after `timeout_s`; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("the engine core did not stop within %.0f s; killing it", timeout_s)
                kill([self.proc])
        shutil.rmtree(self._ipc_dir, ignore_errors=True)
        return self.proc.returncode


def default_engine(config: EngineConfig):
    from agent_infer.engine.launch import launch_engine

    return launch_engine(config, detokenize=False)


def leave_a_cpu_to_the_loop(config: EngineConfig) -> None:
    """On a CPU, the model's forward passes and the core's host work (scheduling, grammar
    masks built during the forward pass, messages) share the cores. torch's spinning
    intra-op threads must not take them all: with every core in the thread pool, one more
    busy thread anywhere on the machine stalls each parallel region until the preempted
    thread runs again (structured decoding ran many times slower next to a single niced
    busy process). So torch gets one thread fewer than the CPUs, as vLLM's CPU backend
    reserves one; an OMP_NUM_THREADS in the environment is left to decide."""
    import torch

    if "OMP_NUM_THREADS" in os.environ or config.resolve_device().type != "cpu":
        return
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) - 1))


def core_main() -> None:
    """The core process's entry (`python -m agent_infer.core`)."""
    spec, status_fd = read_spec()
    # A parent gone while the model loads takes the load with it (SIGTERM's default action
    # until the core installs its handlers; after that the core stops as for any SIGTERM).
    signal_on_parent_death(signal.SIGTERM)
    if os.getppid() != spec.parent_pid:  # it went before the line above could see it
        sys.exit(1)
    logging.basicConfig(level=getattr(logging, spec.log_level.upper()), format=LOG_FORMAT)
    logging.getLogger("agent_infer").setLevel(getattr(logging, spec.log_level.upper()))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor stops the core, after the front ends
    try:
        leave_a_cpu_to_the_loop(spec.engine_config)
        engine = (spec.engine_factory or default_engine)(spec.engine_config)
        core = EngineCore(engine, spec.core_config, spec.address, spec.parent_pid)
    except (ConfigError, ValueError, FileNotFoundError, NotImplementedError) as e:
        report_status(status_fd, "error", str(e))
        sys.exit(1)
    except BaseException as e:
        log.exception("the engine core could not start")
        report_status(status_fd, "error", f"the engine core could not start ({type(e).__name__}: {e})")
        sys.exit(1)
    core.install_signal_handlers()
    code = core.run() if report_status(status_fd, "ready", core.info()) else 1  # else: nobody to serve
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without interpreter teardown: NCCL / symmetric-memory destructors were seen to
    # abort a process after all its work was done.
    os._exit(code)
