"""The locks that say who uses a shared region's file (`tiering.cpu.shared_region`).

Every process that maps a region holds a shared `flock` on its file, and each role (the
scheduler side, each worker rank) an open-file-description byte lock on its own byte. A file
nobody holds either lock on belongs to no live process: the kernel drops both locks when
their process dies, however it dies. That is the only proof of death the regions rely on,
never a timeout or a name.

Thread: any; each call works on the file descriptor it is given.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
from pathlib import Path

_LOCK = "hhqqi"  # struct flock: type, whence, start, length, pid


def hold_role(fd: int, role: int) -> bool:
    """Lock `role`'s byte of `fd`'s file for this open file description; False if another
    holds it.

    Raises:
        OSError: the lock cannot be taken for another reason.
    """
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack(_LOCK, fcntl.F_WRLCK, os.SEEK_SET, role, 1, 0))
    except OSError as exc:
        if exc.errno not in (errno.EAGAIN, errno.EACCES):
            raise
        return False
    return True


def role_held(fd: int, role: int | None) -> bool:
    """Whether another open file description holds `role`'s byte of `fd`'s file (None: any
    byte, so any role of a region of any geometry)."""
    start, length = (0, 0) if role is None else (role, 1)
    probe = struct.pack(_LOCK, fcntl.F_WRLCK, os.SEEK_SET, start, length, 0)
    return struct.unpack(_LOCK, fcntl.fcntl(fd, fcntl.F_OFD_GETLK, probe))[0] != fcntl.F_UNLCK


def take_abandoned(path: Path, fd: int) -> bool:
    """Whether `fd`'s file, still named `path`, is used by no live process. If so, this open
    file description keeps an exclusive `flock` on it until it closes or changes it, so no
    other process can take it meanwhile. Raises nothing."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False  # a live process maps it
    if role_held(fd, None) or not is_current(path, fd):  # one claiming it, or renamed meanwhile
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    return True


def is_current(path: Path, fd: int) -> bool:
    """Whether `path` still names `fd`'s file."""
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False
