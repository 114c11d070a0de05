"""The control channel from rank 0 to the tensor-parallel workers.

Rank 0 listens on a free TCP port (published through the process group's store, so it
works across machines too); each worker connects once and receives one message per step
(the step's host arrays), acknowledging each. A reader thread on rank 0 watches every
worker socket: an error report or a closed connection (the worker died) is recorded at
once, so the engine fails loudly instead of waiting on a collective that will never
complete. If the engine thread is stuck inside such a collective and does not notice
within `grace_s`, the watchdog ends the process itself (after stopping the workers).
"""

from __future__ import annotations

import logging
import os
import pickle
import select
import socket
import struct
import sys
import threading
import time
from typing import Any, Callable

log = logging.getLogger(__name__)

_HEADER = struct.Struct("!Q")


class WorkerError(RuntimeError):
    """A tensor-parallel worker died or failed; the engine cannot go on."""


def _send(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_HEADER.pack(len(payload)) + payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    chunks = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def recv_message(sock: socket.socket) -> Any | None:
    """One message, or None when the peer closed the connection."""
    header = _recv_exact(sock, _HEADER.size)
    if header is None:
        return None
    body = _recv_exact(sock, _HEADER.unpack(header)[0])
    return None if body is None else pickle.loads(body)


class ControlServer:
    def __init__(self, host: str, num_workers: int):
        self.num_workers = num_workers
        self._listener = socket.create_server((host, 0))
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        self._socks: dict[int, socket.socket] = {}
        self.failure: str | None = None
        self.acked: dict[int, int] = {}
        self.closing = False  # set before an orderly shutdown
        self._reader: threading.Thread | None = None
        self._on_fatal: Callable[[str], None] | None = None
        self._noticed = threading.Event()

    def accept_all(self, timeout_s: float, alive: Callable[[], str | None] = lambda: None) -> None:
        """Wait for every worker to connect; `alive()` names a worker that died meanwhile."""
        deadline = time.monotonic() + timeout_s
        self._listener.settimeout(0.5)
        while len(self._socks) < self.num_workers:
            dead = alive()
            if dead:
                raise WorkerError(dead)
            if time.monotonic() > deadline:
                raise WorkerError(f"only {len(self._socks)} of {self.num_workers} workers connected within {timeout_s:.0f} s")
            try:
                conn, _ = self._listener.accept()
            except socket.timeout:
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(None)
            hello = recv_message(conn)
            if not (isinstance(hello, tuple) and hello[0] == "hello"):
                conn.close()
                continue
            self._socks[hello[1]] = conn
        self._listener.close()

    def start_watch(self, on_fatal: Callable[[str], None], grace_s: float = 10.0) -> None:
        self._on_fatal = on_fatal
        self._grace_s = grace_s
        self._reader = threading.Thread(target=self._watch, name="agent-infer-control", daemon=True)
        self._reader.start()

    def _watch(self) -> None:
        socks = {s: r for r, s in self._socks.items()}
        while socks and not self.closing:
            try:
                ready, _, _ = select.select(list(socks), [], [], 0.5)
            except (OSError, ValueError):
                return  # closed under us during shutdown
            for s in ready:
                rank = socks[s]
                try:
                    msg = recv_message(s)
                except OSError:
                    msg = None
                if msg is None:
                    if self.closing:
                        return
                    self._fail(f"tensor-parallel worker {rank} exited unexpectedly")
                    socks.pop(s)
                elif msg[0] == "ack":
                    self.acked[rank] = msg[1]
                elif msg[0] == "error":
                    self._fail(f"tensor-parallel worker {rank} failed: {msg[1]}")
        if self.failure and not self.closing:
            # The engine thread may be blocked in a collective with the dead rank. Give it
            # `grace_s` to notice; otherwise stop everything ourselves.
            if not self._noticed.wait(self._grace_s) and self._on_fatal is not None:
                self._on_fatal(self.failure)

    def _fail(self, message: str) -> None:
        if self.failure is None:
            self.failure = message
            log.error("%s", message)

    def check(self) -> None:
        if self.failure is not None:
            self._noticed.set()
            raise WorkerError(self.failure)

    def broadcast(self, message: Any) -> None:
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, sock in self._socks.items():
            try:
                _send(sock, payload)
            except OSError as e:
                self._fail(f"tensor-parallel worker {rank} is unreachable ({e})")
                self.check()

    def wait_disconnected(self, timeout_s: float) -> None:
        """After telling the workers to stop (`closing` set): wait, bounded, until each has
        closed its end, which it does last, after leaving the process group. Tearing
        the group down on rank 0 while a worker was still in it sometimes aborted rank 0
        at interpreter exit (gloo: "terminate called without an active exception")."""
        deadline = time.monotonic() + timeout_s
        if self._reader is not None:  # it stops within its 0.5 s poll once `closing` is set
            self._reader.join(timeout_s)
        for sock in list(self._socks.values()):
            try:
                while True:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return
                    sock.settimeout(left)
                    if not sock.recv(1 << 16):
                        break
            except OSError:
                continue

    def close(self) -> None:
        self.closing = True
        self._noticed.set()
        for s in self._socks.values():
            try:
                s.close()
            except OSError:
                pass
        self._socks.clear()


class ControlClient:
    def __init__(self, address: str, rank: int, connect_timeout_s: float = 120.0):
        host, port = address.rsplit(":", 1)
        deadline = time.monotonic() + connect_timeout_s
        while True:
            try:
                self.sock = socket.create_connection((host, int(port)), timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.settimeout(None)
        self.send(("hello", rank))

    def send(self, message: Any) -> None:
        _send(self.sock, pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def recv(self) -> Any | None:
        return recv_message(self.sock)

    def close(self) -> None:
        self.sock.close()


def exit_now(message: str, cleanup: Callable[[], None]) -> None:
    """Last resort when the engine thread cannot be woken: say why, stop workers, exit."""
    print(f"agent-infer: error: {message}; shutting down", file=sys.stderr, flush=True)
    try:
        cleanup()
    finally:
        os._exit(1)
