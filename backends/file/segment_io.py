"""The segment layout's files (`tiering.backends.file.segments`): opening, punching holes, the
vectored reads and writes at an offset, and the walk that lists a segment's entries.

Worker threads of the file tier's pools (plain functions; `Segment`'s counts are guarded by
the `SegmentLog` lock).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from tiering.backends.buffers import advance
from tiering.backends.file.dirs import OPEN_FLAGS
from tiering.backends.file.objects import ALIGN
from tiering.contract.keys import OffloadKey
from tiering.errors import CorruptObjectError, ForgedObjectError, is_no_space
from tiering.tiers.object_format import MAGIC, announced, parse_header
from tiering.tiers.seal import Seal

logger = logging.getLogger(__name__)

SUFFIX = ".seg"
MAX_IOV = 1024  # buffers one vectored call takes (IOV_MAX on Linux)
_PUNCH = 0x01 | 0x02  # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
_thread_local = threading.local()


def padded(nbytes: int) -> int:
    """`nbytes` rounded up to a whole page."""
    return -(-nbytes // ALIGN) * ALIGN


def punch(fd: int, offset: int, length: int) -> None:
    """Free the disk space of ``[offset, offset + length)`` of `fd`; it reads as zeros after.

    Raises:
        OSError: the filesystem cannot punch holes (EOPNOTSUPP), or the call fails.
    """
    if _libc.fallocate(fd, _PUNCH, offset, length) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


@dataclass(eq=False)
class Segment:
    """One segment file, its descriptors open for reads and appends (and with O_DIRECT,
    `direct_fd`), or -1 while closed (`tiering.backends.file.segment_fds`)."""

    sequence: int
    fd: int
    direct_fd: int
    tail: int = 0  # bytes reserved by appends
    live: int = 0  # entries the map points at
    live_bytes: int = 0  # the bytes those entries take
    users: int = 0  # calls that may read or write it now: it is not removed until they end
    in_io: int = 0  # system calls using its descriptors now (`segment_fds`): not closed meanwhile
    name: str = field(init=False)

    def __post_init__(self) -> None:
        self.name = f"{self.sequence:016x}{SUFFIX}"

    def fd_for(self, direct: bool) -> int:
        """The descriptor to move page-aligned buffers with: the O_DIRECT one if `direct` and
        the segment has one, else the buffered one."""
        return self.direct_fd if direct and self.direct_fd >= 0 else self.fd


class Entry(NamedTuple):
    """Where one block's object lies: its segment, the offset of its header page (bytes), and
    its payload's length (bytes)."""

    segment: Segment
    offset: int  # of the entry's header page in its segment
    payload_len: int

    @property
    def size(self) -> int:
        """Bytes the entry takes in its segment: the header page and the payload padded to a page."""
        return ALIGN + padded(self.payload_len)


def scratch_pages(count: int) -> memoryview:
    """This thread's page-aligned scratch of at least `count` pages (headers, padding)."""
    view: memoryview | None = getattr(_thread_local, "pages", None)
    if view is None or view.nbytes < count * ALIGN:
        view = _thread_local.pages = memoryview(mmap.mmap(-1, max(count, 32) * ALIGN))
    return view


def sequence_of(name: str) -> int | None:
    """The sequence number a segment's file name holds, or None for any other name."""
    if len(name) != 16 + len(SUFFIX) or not name.endswith(SUFFIX):
        return None
    try:
        return int(name[:16], 16)
    except ValueError:
        return None


def walk(
    segment: Segment, fingerprint: bytes, seal: Seal | None, rejected: list[int]
) -> Iterator[tuple[OffloadKey, Entry, bool]]:
    """(key, entry, whether `seal` opens it) of each whole entry of `segment`, in file order,
    skipping holes (punched entries, ranges never written) and pages that are not an entry's
    header of this layout; the offsets of the pages among them that begin as a header does
    but fail its checks (its checksum among them: torn, or a payload's look-alike) go to `rejected`."""
    fd = segment.fd
    end = os.fstat(fd).st_size
    offset = 0
    while offset < end:
        try:
            offset = os.lseek(fd, offset, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # nothing but a hole past `offset`
                return
            raise
        offset -= offset % ALIGN
        page = os.pread(fd, ALIGN, offset)
        try:
            opens = parse_header(page, fingerprint, seal=seal).size == ALIGN or None
        except ForgedObjectError:
            opens = False
        except CorruptObjectError:
            opens = None
            if page[:4] == MAGIC:
                rejected.append(offset)
        if opens is None:  # a torn or punched header, a page of a payload, not one of ours
            offset += ALIGN
            continue
        key, payload_len = announced(page)
        entry = Entry(segment, offset, payload_len)
        if offset + entry.size > end:
            offset += ALIGN  # cut short by the end of the file
            continue
        yield key, entry, opens
        offset += entry.size


def close_segment(segment: Segment) -> None:
    """Close `segment`'s descriptors (its file stays); they read -1 after."""
    for fd in {segment.fd, segment.direct_fd} - {-1}:
        os.close(fd)
    segment.fd = segment.direct_fd = -1


def open_segment(dir_fd: int, sequence: int, direct: bool, create: bool) -> Segment:
    """Open segment `sequence` of the directory `dir_fd` for reads and writes (and, with
    `direct`, a second descriptor with O_DIRECT); with `create`, a new file (0600), removed
    again if the second open fails.

    Raises:
        FileExistsError: `create` and the file exists.
        OSError: it cannot be opened (a link in its place fails with ELOOP).
    """
    name = f"{sequence:016x}{SUFFIX}"
    flags = os.O_RDWR | OPEN_FLAGS
    fd = os.open(name, flags | (os.O_CREAT | os.O_EXCL if create else 0), 0o600, dir_fd=dir_fd)
    direct_fd = -1
    if direct:
        try:
            direct_fd = os.open(name, flags | os.O_DIRECT, dir_fd=dir_fd)
        except OSError:
            os.close(fd)
            if create:  # half made: left behind, every later create of it would fail
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=dir_fd)
            raise
    return Segment(sequence, fd, direct_fd)


def pwrite_all(fd: int, buffers: list[memoryview], offset: int) -> tuple[int, OSError | None]:
    """Write `buffers` (consumed) to `fd` at byte `offset`, at most 1,024 a call, until all is
    written or a write fails (ENOSPC among them): the bytes written, and the error that
    stopped it (None: all written)."""
    total = 0
    while buffers:
        try:
            written = os.pwritev(fd, buffers[:MAX_IOV], offset + total)
        except OSError as exc:
            return total, exc
        total += written
        advance(buffers, written)
    return total, None


def pread_all(fd: int, buffers: list[memoryview], offset: int) -> int:
    """Fill `buffers` (consumed) from `fd` at byte `offset`, up to the end of the file; the
    bytes read.

    Raises:
        OSError: a read failed."""
    total = 0
    while buffers:
        got = os.preadv(fd, buffers[:MAX_IOV], offset + total)
        if got == 0:
            break
        total += got
        advance(buffers, got)
    return total


def probe_punch(dir_fd: int, path: Path) -> bool:
    """Create, punch and remove a small file in the directory `dir_fd` (named `path` in errors).
    Returns False, having learnt nothing, when the device has no room for the file (its
    stores fail as no-space until it has, as they would with one file per block).

    Raises:
        OSError: the filesystem cannot punch holes (the message says so), or the file cannot
            be made for another reason than a full device.
    """
    name = f".punch-probe-{os.urandom(4).hex()}.tmp"
    try:
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | OPEN_FLAGS, 0o600, dir_fd=dir_fd)
    except OSError as exc:
        if is_no_space(exc):
            return False
        raise
    try:
        try:
            os.pwrite(fd, bytes(2 * ALIGN), 0)
        except OSError as exc:
            if is_no_space(exc):
                return False
            raise
        try:
            punch(fd, 0, ALIGN)
        except OSError as exc:
            raise OSError(exc.errno, f"{path}: the filesystem cannot punch holes ({exc.strerror})") from None
        return True
    finally:
        os.close(fd)
        os.unlink(name, dir_fd=dir_fd)


def runs(entries: list[Entry | None]) -> list[tuple[int, int]]:
    """[start, stop) of each run of consecutive entries that lie side by side in one
    segment (an absent entry is a run of its own, read by no one)."""
    runs = []
    start = 0
    for i in range(1, len(entries) + 1):
        if i < len(entries):
            previous, entry = entries[i - 1], entries[i]
            if (
                previous is not None
                and entry is not None
                and entry.segment is previous.segment
                and entry.offset == previous.offset + previous.size
            ):
                continue
        if entries[start] is not None:
            runs.append((start, i))
        start = i
    return runs
