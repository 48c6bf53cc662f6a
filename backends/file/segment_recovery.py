"""Recovery of the segment layout (`tiering.backends.file.segments`): the entries a
namespace's segments hold when its engine starts.

Recovery walks each segment's data ranges (``SEEK_DATA``): a page that is not a whole entry's
header (a torn write, zeros) is skipped, one that begins as a header but fails its checks
(its own checksum among them) is skipped and counted, an entry that runs past the end of its file
is not listed, and an entry whose payload was torn is found by its checksum when loaded (never
loaded: dropped as corrupt). A key found twice is the later entry's, the earlier punched out.
Entries whose seal does not open (sealed by a key dropped from ``integrity``, or planted:
these segments are this engine's alone) are punched out too, and counted.

The tier's pool thread that opens the store, before any other call.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass

from tiering.backends.file.segment_fds import OpenSegments
from tiering.backends.file.segment_io import Entry, Segment, open_segment, punch, sequence_of, walk
from tiering.contract.keys import OffloadKey
from tiering.tiers.blockstore.store import RecoveryProgress
from tiering.tiers.seal import Seal

logger = logging.getLogger(__name__)


@dataclass
class Recovered:
    """What `recover` found: the segments by sequence, the map of keys to entries (oldest
    first), and the counts of pages skipped as headers that fail their checks and of entries
    punched out because their seal does not open."""

    segments: dict[int, Segment]
    found: dict[OffloadKey, Entry]
    headers_rejected: int
    unopened_reclaimed: int


def recover(
    dir_fd: int, fingerprint: bytes, seal: Seal | None, fds: OpenSegments, progress: RecoveryProgress
) -> Recovered:
    """Map every whole entry of the segments in the directory `dir_fd` (see the module's doc),
    their descriptors kept by `fds`. Files that are not segments are left alone.

    Raises:
        OSError: a segment cannot be opened or read.
    """
    segments: dict[int, Segment] = {}
    found: dict[OffloadKey, Entry] = {}
    stale: list[Entry] = []
    unopened = 0
    rejected: list[int] = []
    for name in sorted(os.listdir(dir_fd)):
        sequence = sequence_of(name)
        if sequence is None:
            continue
        segment = segments[sequence] = open_segment(dir_fd, sequence, fds.direct, create=False)
        fds.opened(segment)
        for key, entry, opens in walk(segment, fingerprint, seal, rejected):
            progress.add()
            segment.tail = entry.offset + entry.size
            if not opens:  # sealed by a key the tier no longer has, or planted: unusable
                unopened += 1
                stale.append(entry)
                continue
            previous = found.pop(key, None)  # re-inserted: the order stays oldest first
            if previous is not None:
                previous.segment.live -= 1
                previous.segment.live_bytes -= previous.size
                stale.append(previous)
            found[key] = entry
            segment.live += 1
            segment.live_bytes += entry.size
        fds.trim(None)
    for entry in stale:
        with contextlib.suppress(OSError):  # else its space comes back with its segment
            fds.use(entry.segment)
            try:
                punch(entry.segment.fd, entry.offset, entry.size)
            finally:
                fds.done(entry.segment, None)
    if unopened:
        logger.warning(
            "file tier: reclaimed %d segment entries whose seal does not open (a key dropped from integrity, "
            "or planted)",
            unopened,
        )
    if rejected:
        logger.warning("file tier: skipped %d pages that begin as a header but fail its checks", len(rejected))
    return Recovered(segments, found, len(rejected), unopened)
