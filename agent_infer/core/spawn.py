"""Starting a child process that reports when it is ready, and the child's side of it.

A child is a fresh interpreter (`python -m module`), not one forked or spawned by
multiprocessing, so nothing of the parent's `__main__` is imported into it. Its spec
arrives pickled on stdin, at once or later (`prestart_child`: the child imports its
modules meanwhile); it answers on a status pipe once it is ready (or with the one-line
reason it could not start). Imports nothing heavy: the server's front ends use it.
"""

from __future__ import annotations

import os
import pickle
import select
import subprocess
import sys
import time
from collections.abc import Callable

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class ChildFailed(RuntimeError):
    """A child process exited, or said it could not start, before it was ready."""


def start_child(module: str, spec, *, pass_fds: tuple[int, ...] = (), new_session: bool = True
                ) -> tuple[subprocess.Popen, int]:
    """`python -m module` with `(spec, status fd)` pickled on its stdin; returns the process
    and the read end of its status pipe. A new session keeps a terminal's Ctrl-C from
    reaching the child: its parent decides when it stops."""
    proc, status, send = prestart_child(module, pass_fds=pass_fds, new_session=new_session)
    send(spec)
    return proc, status


def prestart_child(module: str, *, pass_fds: tuple[int, ...] = (), new_session: bool = True
                   ) -> tuple[subprocess.Popen, int, Callable[[object], None]]:
    """`python -m module` started now, its spec sent later: returns the process, the read
    end of its status pipe and `send(spec)`, which writes `(spec, status fd)` on its stdin.
    Until then the child imports its modules and waits in `read_spec`; if the parent goes
    away first, it exits quietly."""
    read_fd, write_fd = os.pipe()
    # The child imports what this process imports: its path, not the working directory
    # first (`-m` would put it there; -P, on Python >= 3.11, keeps it out).
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    flags = ["-P"] if sys.version_info >= (3, 11) else []
    try:
        proc = subprocess.Popen([sys.executable, *flags, "-m", module], stdin=subprocess.PIPE, env=env,
                                pass_fds=(write_fd, *pass_fds), start_new_session=new_session)
    except BaseException:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)  # the child holds it under the same number (pass_fds)

    def send(spec) -> None:
        try:
            proc.stdin.write(pickle.dumps((spec, write_fd)))
            proc.stdin.close()
        except BrokenPipeError:
            pass  # it died; wait_status reports how

    return proc, read_fd, send


def kill(procs: list[subprocess.Popen]) -> None:
    """SIGKILL to each of `procs` still running, then reap them all."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        proc.wait()


def wait_status(proc: subprocess.Popen, read_fd: int, what: str, timeout_s: float | None = None):
    """The child's ready message; ChildFailed if it exits first, says it failed, or
    (with a timeout) takes too long."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    data = b""
    try:
        while True:
            wait = 0.5 if deadline is None else max(0.0, min(0.5, deadline - time.monotonic()))
            if select.select([read_fd], [], [], wait)[0]:
                chunk = os.read(read_fd, 1 << 16)
                if chunk:
                    data += chunk
                    continue
                break  # EOF: the whole message is in, or the child is gone
            if deadline is not None and time.monotonic() >= deadline:
                raise ChildFailed(f"the {what} did not start within {timeout_s:.0f} s")
    finally:
        os.close(read_fd)
    if not data:
        code = proc.wait()
        raise ChildFailed(f"the {what} exited with code {code} while starting; see the log above")
    kind, payload = pickle.loads(data)
    if kind != "ready":
        proc.wait()
        raise ChildFailed(payload)
    return payload


def report_status(fd: int, kind: str, payload) -> bool:
    """In the child: send the ready message (or the reason for failing) and close the pipe.
    False when nobody reads it any more: the parent is gone."""
    try:
        os.write(fd, pickle.dumps((kind, payload)))
        return True
    except BrokenPipeError:
        return False
    finally:
        os.close(fd)


def read_spec():
    """In the child: the (spec, status fd) its parent wrote on stdin. A parent that went
    away (or gave up starting) before writing it ends the child quietly."""
    try:
        return pickle.load(sys.stdin.buffer)
    except EOFError:
        raise SystemExit(1) from None
