"""The segment layout's open descriptors (`tiering.backends.file.segments`): a tier of any
size holds a bounded number.

A segment's descriptors (one, or two with O_DIRECT) are opened when a call needs them and
kept while it is the active segment, while a system call uses them, or while it is among the
`limit` most recently used others; past that the least recently used idle segment's are
closed, to be opened again at its next use. Without the bound a tier of 64 MiB segments held
32 descriptors per GiB: a soft limit of 1,024 ran out at about 24 GiB, and then every open of
the process failed (vLLM's own among them).

Worker threads of the file tier's pools: every method runs under the `SegmentLog`'s lock.
"""

from __future__ import annotations

from collections import OrderedDict

from tiering.backends.file.segment_io import Segment, close_segment, open_segment

MAX_OPEN_SEGMENTS = 32
"""Segments besides the active one whose descriptors stay open while idle (the most recently
used): at most twice as many descriptors, and those of the calls in flight."""


class OpenSegments:
    """The descriptors of the segments in directory `dir_fd` (see the module's doc).

    Args:
        dir_fd: the open segments directory.
        direct: open a second, O_DIRECT descriptor per segment.
        limit: idle segments whose descriptors stay open, besides the active one (>= 0).
    """

    def __init__(self, dir_fd: int, direct: bool, limit: int = MAX_OPEN_SEGMENTS):
        self.dir_fd, self.direct, self.limit = dir_fd, direct, limit
        self._open: OrderedDict[int, Segment] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        """Segments whose descriptors are open now."""
        return len(self._open)

    def create(self, sequence: int) -> Segment:
        """A new segment file, `sequence`, open (`open_segment`).

        Raises:
            FileExistsError, OSError: as `open_segment`.
        """
        segment = open_segment(self.dir_fd, sequence, self.direct, create=True)
        self._open[sequence] = segment
        return segment

    def opened(self, segment: Segment) -> None:
        """`segment`, opened by its caller (recovery walks every segment), joins the cache."""
        self._open[segment.sequence] = segment

    def use(self, segment: Segment) -> None:
        """A system call is about to use `segment`'s descriptors: open them if closed (they
        stay open until `done`), and make it the most recently used.

        Raises:
            OSError: they cannot be opened (the file is gone, or no descriptor is left).
        """
        if segment.fd < 0:
            again = open_segment(self.dir_fd, segment.sequence, self.direct, create=False)
            segment.fd, segment.direct_fd = again.fd, again.direct_fd
        segment.in_io += 1
        self._open[segment.sequence] = segment
        self._open.move_to_end(segment.sequence)

    def done(self, segment: Segment, active: Segment | None) -> None:
        """The system call `use` announced is over; close idle segments beyond the limit
        (never `active`)."""
        segment.in_io -= 1
        self.trim(active)

    def trim(self, active: Segment | None) -> None:
        """Close the least recently used idle segments while more than `limit` besides
        `active` are open (fewer if the others are all in a system call)."""
        excess = len(self._open) - self.limit - (active is not None and active.sequence in self._open)
        if excess <= 0:
            return
        for segment in list(self._open.values()):
            if segment is not active and not segment.in_io:
                self.forget(segment)
                excess -= 1
                if not excess:
                    return

    def forget(self, segment: Segment) -> None:
        """Close `segment`'s descriptors (it was removed, or leaves the cache)."""
        self._open.pop(segment.sequence, None)
        close_segment(segment)
