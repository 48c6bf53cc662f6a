"""Walking a list of buffers as one stream of bytes: the vectored reads and writes of the file
tier and the S3 tier's uploads and downloads share these.

Thread: any (plain functions over memoryviews).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence


def advance(buffers: list[memoryview], count: int) -> None:
    """Drop the first `count` bytes of the stream `buffers` make, in place: the buffers a
    partial vectored read or write filled, and the filled part of the next one."""
    while buffers and count >= buffers[0].nbytes:
        count -= buffers.pop(0).nbytes
    if buffers and count:
        buffers[0] = buffers[0][count:]


def spans(buffers: Sequence[memoryview], offset: int, count: int) -> Iterator[tuple[memoryview, int, int]]:
    """(buffer, start, length) of the pieces of the stream `buffers` make from byte `offset`,
    `count` bytes long or up to the stream's end, in order."""
    for buffer in buffers:
        if not count:
            return
        if offset >= buffer.nbytes:
            offset -= buffer.nbytes
            continue
        length = min(buffer.nbytes - offset, count)
        yield buffer, offset, length
        count -= length
        offset = 0
