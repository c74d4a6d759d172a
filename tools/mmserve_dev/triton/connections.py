"""Ending the client connections a stopping tritonserver still holds (``mmserve.triton_seam``:
HELD_STREAMS).

A gRPC stream keeps the first request sent on it, and so that request's model, until the stream
ends: a client that keeps a stream open through a stop keeps a model loaded, and tritonserver, which
closes its gRPC connections only after every model has unloaded (2.51; 2.58 and later wait for them
within the same exit timeout), exits 1 at its exit timeout. Once every request has ended (the
drain answered, nothing is in flight), the launcher ends those connections from the server's side:
it takes a duplicate of each socket tritonserver holds for an established connection to its gRPC
port (``pidfd_getfd``, Linux 5.6+; the launcher is tritonserver's parent, which ptrace's rules let
do this) and shuts it down. Triton sees the client gone, ends the stream, and the model unloads.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import socket
import sys

logger = logging.getLogger(__name__)

SYS_PIDFD_GETFD = {"x86_64": 438, "aarch64": 438}
"""``pidfd_getfd``'s syscall number (the same on both architectures the project runs on)."""
_TCP_ESTABLISHED = "01"


def _established_inodes(port: int) -> set[str]:
    """Socket inodes of established TCP connections whose local port is ``port`` (Linux /proc/net)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 9 and fields[3] == _TCP_ESTABLISHED and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    return inodes


def end_connections(pid: int, port: int) -> int:
    """Shut down every established connection to ``port`` that process ``pid`` holds; returns how
    many. 0 where the kernel or the process's privileges do not allow it (logged once)."""
    machine = os.uname().machine
    if not sys.platform.startswith("linux") or machine not in SYS_PIDFD_GETFD:
        return 0
    inodes = _established_inodes(port)
    if not inodes:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return 0
    ended = 0
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if not (target.startswith("socket:[") and target[8:-1] in inodes):
                continue
            copy = libc.syscall(SYS_PIDFD_GETFD[machine], pidfd, int(fd), 0)
            if copy < 0:
                error = ctypes.get_errno()
                logger.warning(
                    "cannot end the connections tritonserver holds (pidfd_getfd: %s)", errno.errorcode.get(error, error)
                )
                break
            with socket.socket(fileno=copy) as sock:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                    ended += 1
                except OSError:
                    pass
    except OSError:
        pass
    finally:
        os.close(pidfd)
    return ended
