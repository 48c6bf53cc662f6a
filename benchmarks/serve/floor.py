"""The disk's floor under a file tier's promotions: how long a raw O_DIRECT read of the bytes
a request promoted takes on the same directory, measured right after the configuration's
server stopped (`disk_floors`).

The raw read takes whole pieces of the files the tier left (skipping holes, which read
without touching the disk), reads as many pieces as the request promoted blocks, each a
block and its header page, at queue depths 1, 4 and 16, a few tries each, and keeps the
median of the tries at the fastest depth: what a reader of those bytes that knew this disk
would wait, typically (a median, as the TTFT it is set against). Successive tries read other
pieces, so that a device's own cache serves no try what an earlier one read.

Thread: the caller's; it starts its own reading threads.
"""

from __future__ import annotations

import errno
import mmap
import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

DEPTHS = (1, 4, 16)
TRIES = 5
ALIGN = 4096  # O_DIRECT alignment of buffers, lengths and offsets


def disk_floors(directory: Path, piece_bytes: int, counts: set[int]) -> dict[int, float] | None:
    """For each count in `counts`, the seconds of the fastest raw O_DIRECT read of that many
    `piece_bytes` pieces of the files under `directory` (see the module docstring).

    Returns:
        None when `directory` holds no whole piece, or its filesystem refuses O_DIRECT
        (tmpfs: the tier read through the page cache there, and the disk set no floor).

    Raises:
        ValueError: `piece_bytes` is not a positive multiple of 4096.
        OSError: a file under `directory` cannot be opened or its data ranges found (other
            than O_DIRECT refused).
    """
    if piece_bytes <= 0 or piece_bytes % ALIGN:
        raise ValueError(f"piece_bytes must be a positive multiple of {ALIGN}, got {piece_bytes}")
    fds: list[int] = []
    try:
        try:
            pieces = _pieces(directory, piece_bytes, fds)
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # (EINVAL: no O_DIRECT on this filesystem)
                raise
            return None
        if not pieces or not counts:
            return None if not pieces else {}
        with ThreadPoolExecutor(max(DEPTHS)) as pool:
            reader = _Reader(pieces, piece_bytes, pool)
            return {count: min(reader.median_s(count, depth) for depth in DEPTHS) for count in counts}
    finally:
        for fd in fds:
            os.close(fd)


def _pieces(directory: Path, piece_bytes: int, fds: list[int]) -> list[tuple[int, int]]:
    """(descriptor, offset) of every whole aligned piece of data in the regular files under
    `directory`, each file opened once with O_DIRECT (its descriptor added to `fds`)."""
    pieces: list[tuple[int, int]] = []
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            if not os.path.isfile(path) or os.path.islink(path):
                continue
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            fds.append(fd)
            pieces.extend((fd, offset) for offset in _data_offsets(fd, piece_bytes))
    return pieces


def _data_offsets(fd: int, piece_bytes: int) -> list[int]:
    """Aligned offsets of whole `piece_bytes` pieces within the data (not the holes) of `fd`."""
    offsets: list[int] = []
    end, at = os.fstat(fd).st_size, 0
    while at < end:
        try:
            start = os.lseek(fd, at, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno != errno.ENXIO:  # (ENXIO: only a hole from here)
                raise
            break
        stop = os.lseek(fd, start, os.SEEK_HOLE)
        first = -(-start // ALIGN) * ALIGN
        offsets.extend(range(first, stop - piece_bytes + 1, piece_bytes))
        at = stop
    return offsets


class _Reader:
    """Reads pieces round the list, each try from where the last one stopped."""

    def __init__(self, pieces: list[tuple[int, int]], piece_bytes: int, pool: ThreadPoolExecutor):
        self._pieces = pieces
        self._next = 0
        self._buffers = [memoryview(mmap.mmap(-1, piece_bytes)) for _ in range(max(DEPTHS))]
        self._pool = pool
        started = threading.Barrier(max(DEPTHS))  # every thread up before the first timed read
        list(pool.map(lambda _: started.wait(), range(max(DEPTHS))))

    def median_s(self, count: int, depth: int) -> float:
        """The median seconds of `TRIES` reads of `count` pieces, `depth` at a time."""
        return statistics.median(self.read_s(count, depth) for _ in range(TRIES))

    def read_s(self, count: int, depth: int) -> float:
        """Seconds to read `count` pieces, `depth` at a time."""
        batch = [self._pieces[(self._next + i) % len(self._pieces)] for i in range(count)]
        self._next = (self._next + count) % len(self._pieces)
        lanes = [batch[lane::depth] for lane in range(depth)]

        def read(lane: int) -> None:
            for fd, offset in lanes[lane]:
                os.preadv(fd, [self._buffers[lane]], offset)

        start = time.perf_counter()
        list(self._pool.map(read, range(depth)))
        return time.perf_counter() - start
