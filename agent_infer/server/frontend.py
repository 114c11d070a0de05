"""One front-end process: the app on uvicorn, on the listening socket its supervisor
shares with every front end (the kernel hands each connection to one of them), and the
way it stops.

SIGTERM or SIGINT starts a drain: no new requests (503 with Retry-After, /health too),
the ones in flight may finish for up to the shutdown timeout, then the rest are ended
(streams with a finish_reason "abort" chunk, an error and [DONE]; others a 503), and
uvicorn closes. Exit code 0. If the engine core goes away, requests get 503s at once and
the process exits with code 1 a moment later.

Started by the supervisor as `python -m agent_infer.server.frontend`, its settings
pickled on stdin (see agent_infer/core/spawn.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import time

import uvicorn

from agent_infer.core.client import CoreClient
from agent_infer.core.spawn import LOG_FORMAT, read_spec, report_status
from agent_infer.core.watch import signal_on_parent_death
from agent_infer.loader.tokenizer import tokenizers_only
from agent_infer.server.app import build_front_end
from agent_infer.server.errors import ShuttingDownError
from agent_infer.server.serving import FrontEndState

log = logging.getLogger("agent_infer.server")

_CORE_GONE_GRACE_S = 1.0  # requests in flight get their 503 before the process leaves


class DrainingServer(uvicorn.Server):
    """uvicorn whose SIGTERM / SIGINT drains the front end instead of closing at once."""

    def __init__(self, config: uvicorn.Config, state: FrontEndState, client: CoreClient, shutdown_timeout_s: float,
                 on_ready=None, name: str = "0"):
        super().__init__(config)
        self.name = name
        self.state = state
        self.client = client
        self.shutdown_timeout_s = shutdown_timeout_s
        self.exit_code = 0
        self._on_ready = on_ready
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Task | None = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)
        if self.started:
            self.client.on_dead(self._core_gone)
            if self._on_ready is not None:
                self._on_ready()

    def handle_exit(self, sig: int, frame) -> None:
        """The signal handler (main thread, between the loop's callbacks)."""
        if self._loop is None or self.should_exit:
            super().handle_exit(sig, frame)  # not serving yet, or stopping already: uvicorn's way
            return
        self._loop.call_soon_threadsafe(self._begin, signal.Signals(sig).name)

    def _begin(self, why: str) -> None:
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self.drain(why))

    async def drain(self, why: str) -> None:
        self.state.draining = True
        timeout = self.shutdown_timeout_s
        log.info("front end %s, shutdown (%s): admitting no new requests; %d in flight may finish within %.0f s",
                 self.name, why, self.client.num_in_flight, timeout)
        deadline = time.monotonic() + timeout
        while self.client.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = self.client.num_in_flight
        if left:
            self.client.abort_all(ShuttingDownError(f"the server is shutting down; this request was stopped "
                                                    f"after {timeout:.0f} s"))
            log.warning("front end %s, shutdown: %d request(s) still running after %.0f s were aborted", self.name,
                        left, timeout)
        else:
            log.info("front end %s, shutdown: every request in flight finished", self.name)
        self.should_exit = True

    def _core_gone(self, reason: str) -> None:
        log.error("front end %s: the engine core is gone (%s); answering 503 and stopping", self.name, reason)
        self.exit_code = 1
        self._loop.call_later(_CORE_GONE_GRACE_S, setattr, self, "should_exit", True)


def front_end_main() -> None:
    """The front-end process's entry."""
    tokenizers_only()
    (spec, sock_fd, index, shutdown_timeout_s, log_level), status_fd = read_spec()
    logging.basicConfig(level=getattr(logging, log_level.upper()), format=LOG_FORMAT)
    logging.getLogger("agent_infer").setLevel(getattr(logging, log_level.upper()))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    signal_on_parent_death(signal.SIGTERM)
    sock = socket.socket(fileno=sock_fd)
    state = FrontEndState()
    app = build_front_end(spec, state)

    def ready() -> None:
        log.info("front end %d ready (pid %d)", index, os.getpid())
        report_status(status_fd, "ready", os.getpid())

    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5)
    server = DrainingServer(config, state, app.state.client, shutdown_timeout_s, on_ready=ready, name=str(index))
    server.run(sockets=[sock])
    log.info("front end %d stopped", index)
    sys.exit(server.exit_code)


if __name__ == "__main__":
    front_end_main()
