"""Knowing at once when another process exits, whether or not it is our child.

Linux gives a pidfd (`os.pidfd_open`) that becomes readable when the process exits, even
while it is an unreaped zombie, so a poller or an event loop can wait on it with the
rest of its work. Where there is none (old kernels, other systems, a sandbox that
refuses the call), `exited()` falls back to asking the kernel about the pid.
"""

from __future__ import annotations

import os
import select


class ProcessWatch:
    def __init__(self, pid: int, fd: int | None):
        self.pid = pid
        self.fd = fd  # readable once the process has exited; None without pidfd support
        self._exited = False

    @classmethod
    def of(cls, pid: int) -> "ProcessWatch":
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            watch = cls(pid, None)
            watch._exited = True
            return watch
        except (AttributeError, OSError):
            fd = None
        return cls(pid, fd)

    def exited(self) -> bool:
        if not self._exited:
            self._exited = _fd_ready(self.fd) if self.fd is not None else not alive(self.pid)
        return self._exited

    def close(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)


def _fd_ready(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def signal_on_parent_death(sig: int) -> None:
    """Linux: have the kernel send `sig` to this process when its parent exits, so a
    child never outlives the supervisor that started it (elsewhere: nothing)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
