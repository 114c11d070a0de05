"""`agent-infer serve`'s process model: a supervisor, one engine core, N front ends.

    supervisor (this process: binds the port, starts and watches the others)
      |- engine core   (agent_infer.core: the engine, the GPU, the TP workers)
      |- front end x N (agent_infer.server.frontend: HTTP, templates, text; one port)

The front ends share the listening socket, one accept queue: each connection goes to
whichever front end accepts it first, so a busy one leaves new connections to the others
(how an idle server's connections spread is the scheduler's choice, not an even split);
each talks to the core over ZMQ. They start with the core and import their modules while
it loads; what they serve (the core's facts and address) reaches them once it is up. The
children run in sessions of their own, so a terminal's Ctrl-C reaches the supervisor
only, and it decides the order:

* SIGTERM / SIGINT: every front end drains (no new requests, those in flight finish for
  up to --shutdown-timeout, the rest are ended with an abort), then the core stops;
  exit code 0. A second SIGINT kills everything at once.
* The core dies: the front ends answer 503 and exit by themselves; exit code 1.
* A front end dies: the others keep serving (the core aborts its requests); when none
  is left, the core is stopped; exit code 1.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from agent_infer.config import ConfigError, EngineConfig
from agent_infer.core.config import CoreConfig
from agent_infer.core.process import CoreProcess
from agent_infer.core.spawn import ChildFailed, kill, prestart_child, wait_status
from agent_infer.core.watch import ProcessWatch
from agent_infer.server.app import FrontEndSpec

log = logging.getLogger("agent_infer.server")

_FORCED_EXIT = 130
_EXIT_GRACE_S = 10.0  # beyond the drain: uvicorn's own close, the last writes


@dataclass(frozen=True)
class ServeOptions:
    host: str
    port: int
    api_server_count: int = 1
    shutdown_timeout_s: float = 30.0
    log_level: str = "info"

    def __post_init__(self) -> None:
        if self.api_server_count < 1:
            raise ValueError(f"--api-server-count must be >= 1, got {self.api_server_count}")
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"--shutdown-timeout must be >= 0, got {self.shutdown_timeout_s}")


@dataclass
class _FrontEnd:
    index: int
    proc: subprocess.Popen
    watch: ProcessWatch


@dataclass
class _Starting:
    """A front-end process waiting for its spec (`send`), and its status pipe."""

    index: int
    proc: subprocess.Popen
    status: int
    send: Callable[[object], None]


class Supervisor:
    def __init__(self, options: ServeOptions):
        self.options = options
        self._wakeup_r, self._wakeup_w = os.pipe()
        os.set_blocking(self._wakeup_r, False)
        os.set_blocking(self._wakeup_w, False)
        self._signals: list[int] = []

    def run(self, engine_config: EngineConfig, core_config: CoreConfig, **spec_fields) -> int:
        """Serve until told to stop or a child fails; the exit code. `spec_fields` fill the
        FrontEndSpec once the core is up (its CoreInfo and address come from it)."""
        opts = self.options
        sock = _listen(opts.host, opts.port)
        host, port = sock.getsockname()[:2]
        # Until every process is up, SIGTERM aborts the start as Ctrl-C does.
        signal.signal(signal.SIGTERM, _interrupt)
        try:
            pending = self._prestart_front_ends(sock)
            try:
                core = CoreProcess.start(engine_config, core_config, log_level=opts.log_level)
            except BaseException:
                kill([fe.proc for fe in pending])
                raise
            try:
                front_ends = self._start_front_ends(pending, FrontEndSpec(core.info, core.address, **spec_fields),
                                                    sock)
            except BaseException:
                core.stop(timeout_s=10)
                raise
        finally:
            sock.close()  # the front ends hold it now (or nobody does)
        print(f"agent-infer: serving {spec_fields['config'].served_model_name} on http://{host}:{port} (max_model_len "
              f"{core.info.max_model_len}, {len(front_ends)} front end{'s' * (len(front_ends) > 1)})",
              file=sys.stderr, flush=True)
        self._install_signal_handlers()
        return self._supervise(core, front_ends)

    # ---- starting -------------------------------------------------------------------------------

    def _prestart_front_ends(self, sock: socket.socket) -> list[_Starting]:
        """The front-end processes, started before the core so that their imports overlap
        its loading; each waits for its spec."""
        pending = []
        try:
            for index in range(self.options.api_server_count):
                pending.append(_Starting(index, *prestart_child("agent_infer.server.frontend",
                                                                 pass_fds=(sock.fileno(),))))
        except BaseException:
            kill([fe.proc for fe in pending])
            raise
        return pending

    def _start_front_ends(self, pending: list[_Starting], spec: FrontEndSpec, sock: socket.socket) -> list[_FrontEnd]:
        """Each waiting front end gets its spec; returns them once every one is ready."""
        for fe in pending:
            fe.send((replace(spec, name=str(fe.index)), sock.fileno(), fe.index, self.options.shutdown_timeout_s,
                     self.options.log_level))
        front_ends = []
        try:
            for fe in pending:
                wait_status(fe.proc, fe.status, f"front end {fe.index}")
                front_ends.append(_FrontEnd(fe.index, fe.proc, ProcessWatch.of(fe.proc.pid)))
        except BaseException as e:
            kill([fe.proc for fe in pending])
            if isinstance(e, ChildFailed):
                raise ConfigError(str(e)) from None  # one line, like the core's own failures
            raise
        return front_ends

    # ---- running --------------------------------------------------------------------------------

    def _install_signal_handlers(self) -> None:
        def on_signal(sig, frame):
            self._signals.append(sig)
            try:
                os.write(self._wakeup_w, b"\0")
            except OSError:
                pass

        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)

    def _supervise(self, core: CoreProcess, front_ends: list[_FrontEnd]) -> int:
        core_watch = ProcessWatch.of(core.pid)
        failed = False
        while True:
            self._wait([core_watch, *(fe.watch for fe in front_ends)])
            if self._signals:
                return self._shutdown(core, front_ends, failed)
            if core_watch.exited():
                code = core.proc.wait()
                log.error("the engine core exited with code %s; the front ends stop", code)
                self._await_exit(front_ends, _EXIT_GRACE_S)
                core.stop()
                return 1
            for fe in [fe for fe in front_ends if fe.watch.exited()]:
                front_ends.remove(fe)
                failed = True
                log.error("front end %d (pid %d) exited with code %s; %d still serving", fe.index, fe.proc.pid,
                          fe.proc.wait(), len(front_ends))
            if not front_ends:
                log.error("no front end is left; stopping the engine core")
                core.stop()
                return 1

    def _wait(self, watches: list[ProcessWatch]) -> None:
        fds = [w.fd for w in watches if w.fd is not None]
        timeout = None if len(fds) == len(watches) else 0.5
        ready = select.select([self._wakeup_r, *fds], [], [], timeout)[0]
        if self._wakeup_r in ready:
            try:
                os.read(self._wakeup_r, 4096)
            except BlockingIOError:
                pass

    def _shutdown(self, core: CoreProcess, front_ends: list[_FrontEnd], failed: bool) -> int:
        timeout = self.options.shutdown_timeout_s
        log.info("shutdown (%s): %d front end(s) drain for up to %.0f s, then the engine core stops",
                 signal.Signals(self._signals[0]).name, len(front_ends), timeout)
        for fe in front_ends:
            if fe.proc.poll() is None:
                fe.proc.send_signal(signal.SIGTERM)
        forced = not self._await_exit(front_ends, timeout + _EXIT_GRACE_S, stop_on_second_signal=True)
        codes = [fe.proc.returncode for fe in front_ends]
        log.info("shutdown: front ends stopped (exit codes %s); stopping the engine core", codes)
        core_code = core.stop(timeout_s=5.0 if forced else 30.0)
        log.info("shutdown: engine core stopped (exit code %s)", core_code)
        if forced:
            return _FORCED_EXIT
        return 0 if not failed and core_code == 0 and all(c == 0 for c in codes) else 1

    def _await_exit(self, front_ends: list[_FrontEnd], timeout_s: float, stop_on_second_signal: bool = False) -> bool:
        """Wait for the front ends to exit; kill what is left after `timeout_s` (or at a
        second SIGINT). False when anything had to be killed."""
        deadline = time.monotonic() + timeout_s
        seen = len(self._signals)
        while any(fe.proc.poll() is None for fe in front_ends):
            if time.monotonic() >= deadline or (stop_on_second_signal and signal.SIGINT in self._signals[seen:]):
                for fe in front_ends:
                    if fe.proc.poll() is None:
                        log.warning("front end %d did not stop; killing it", fe.index)
                        fe.proc.kill()
                for fe in front_ends:
                    fe.proc.wait()
                return False
            select.select([self._wakeup_r], [], [], 0.1)
        return True


def _interrupt(sig, frame) -> None:
    raise KeyboardInterrupt


def _listen(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)  # connections queue here until a front end is up to accept them
    sock.set_inheritable(True)
    return sock

