"""Entering a network namespace, for tiers whose clients must live in one (a Mooncake pool
on a fabric of its own, a test's pool alone with ``lo``): a thread that enters it opens every
socket there, and the threads it starts afterwards are born in it.

Thread: the thread that is to move; it must not be the loop thread (its sockets would move).
"""

from __future__ import annotations

import ctypes
import os

CLONE_NEWNET = 0x40000000


def enter_network_namespace(path: str) -> None:
    """Move the calling thread into the network namespace at `path` (``/var/run/netns/NAME``,
    ``/proc/PID/ns/net``).

    Raises:
        OSError: the namespace cannot be opened or entered (entering needs CAP_SYS_ADMIN).
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, CLONE_NEWNET) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"cannot enter the network namespace {path}: {os.strerror(error)}")
    finally:
        os.close(fd)
