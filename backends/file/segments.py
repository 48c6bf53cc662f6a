"""The file tier's segment layout: many small blocks per file, a job's blocks in one system
call.

Worker threads of the tier's pools: every method of `SegmentLog` may run in any of them at
once (one lock guards the map and the segments' counts; no system call on a block's bytes
runs under it).

Layout: ``<namespace>/segments/<sequence, 16 hex>.seg``. A segment is a sequence of entries,
each one object exactly as a one-file-per-block object is (`tiering.tiers.object_format`: a
header padded to a page, then the payload), padded with zeros to a page so that every entry
starts page-aligned (O_DIRECT). A `put_many` appends its blocks together, in one vectored
write at a range it reserved at the tail of the active segment; a `get_many` reads each run
of blocks that lie side by side in one vectored read, and checks every block's header,
length and checksum (or seal) in the thread that read it. Entries are never rewritten: a deleted
block's range is punched out of its file (``fallocate(PUNCH_HOLE)``, its disk space freed at
once) and a segment whose blocks are all deleted is removed; a segment left sparse by deletes
has its live entries copied to the active one (`SPARSE`), so that it goes too. At most
`segment_fds.MAX_OPEN_SEGMENTS` idle segments keep their descriptors open.

Recovery (`segment_recovery`) maps the entries the segments hold. The map of keys to
entries lives in memory only, so a namespace's segments are one engine's: `open_log` takes
an exclusive lock on the segments directory, and a second engine fails to open it, naming it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

from tiering.backends.file.dirs import private_subdir
from tiering.backends.file.objects import ALIGN, is_aligned
from tiering.backends.file.segment_fds import OpenSegments
from tiering.backends.file.segment_io import (
    Entry,
    Segment,
    padded,
    pread_all,
    probe_punch,
    punch,
    pwrite_all,
    runs,
    scratch_pages,
    walk,
)
from tiering.backends.file.segment_recovery import recover
from tiering.contract.keys import OffloadKey
from tiering.errors import CorruptObjectError, ForgedObjectError, ObjectNotFoundError
from tiering.tiers.blockstore.store import RecoveryProgress
from tiering.tiers.object_format import ObjectHeader, check_length, encode_object, parse_header, verify_payload
from tiering.tiers.seal import Seal

logger = logging.getLogger(__name__)

SEGMENT_BYTES = 64 << 20
"""An active segment takes appends until it holds this many bytes (a batch never splits)."""
SPARSE = 8
"""A segment whose live entries take less than 1/SPARSE of its bytes is compacted: at most
that share of a segment's bytes is written twice."""
_ZEROS = memoryview(bytes(ALIGN))  # what pads an entry to its next page


SEGMENT_READ_THREADS = 4
"""Segments are read by at most this many threads: a call reads a whole batch (blocks side by
side) in one request, and a device serves a few large requests faster than many."""


class SegmentLog:
    """The segments of one namespace and the map of their entries (see the module's doc): the
    ``segments`` `tiering.backends.file.store.Layout`.

    Args:
        dir_fd: the open segments directory, locked (see `open_log`; closed by `close`).
        fingerprint, seal: the tier's layout fingerprint and seal, as objects carry them.
        direct: use O_DIRECT for payloads that are page-aligned in memory and length.
        fsync: `fdatasync` a segment after each append, before its blocks are listed.
    """

    name = "segments"
    max_read_threads: int | None = SEGMENT_READ_THREADS
    exists_needs_io = False  # the map answers

    def __init__(
        self,
        dir_fd: int,
        fingerprint: bytes,
        seal: Seal | None,
        direct: bool,
        fsync: bool,
    ):
        self.dir_fd = dir_fd
        self.fingerprint = fingerprint
        self.seal = seal
        self.direct = direct
        self.fsync = fsync
        self.segment_bytes = SEGMENT_BYTES
        self._lock = threading.Lock()
        self._map: dict[OffloadKey, Entry] = {}
        self._segments: dict[int, Segment] = {}
        self._fds = OpenSegments(dir_fd, direct)
        self._active: Segment | None = None
        self.path = Path()  # for log lines (`open_log` sets it)
        self.recovered: list[tuple[OffloadKey, int]] | None = None  # what `recover` found
        self._recovering = threading.Lock()
        self.headers_rejected = 0  # pages recovery skipped that began as a header but failed its checks
        self.unopened_reclaimed = 0  # entries recovery punched out because their seal does not open

    # -- writes -----------------------------------------------------------------------------

    def put_many(self, items: Sequence[tuple[OffloadKey, memoryview]]) -> list[Exception | None]:
        """Append `items` as entries of the active segment, in one vectored write (or a few,
        past 1,024 buffers); their keys are listed once all are written, and the entries they
        replace punched out. If a write fails part way (a full device), the items written
        whole before it are listed, the others fail with its error and their range is
        punched out; if the `fdatasync` fails, every item fails."""
        self.recover()  # once: a store used before `recover` maps its segments first
        headers, payloads = [], []
        for key, payload in items:
            header, body = encode_object(key, payload.cast("B"), self.fingerprint, ALIGN, self.seal)
            headers.append(header)
            payloads.append(body)
        return self._append([key for key, _ in items], headers, payloads)

    def _append(
        self,
        keys: list[OffloadKey],
        headers: Sequence[bytes | memoryview],
        payloads: list[memoryview],
        moving: list[Entry] | None = None,
    ) -> list[Exception | None]:
        """`put_many` of entries made already (header pages, payloads); with `moving` (a
        compaction's copies of those entries), a key is listed at its copy only if it still
        holds its entry there, which is left to its segment's removal (never punched under a
        read), and the other copies are punched out."""
        sizes = [ALIGN + padded(payload.nbytes) for payload in payloads]
        total = sum(sizes)
        direct = self.direct and all(is_aligned(payload) for payload in payloads)
        pages = scratch_pages(len(keys))
        buffers: list[memoryview] = []
        for i, (header, payload) in enumerate(zip(headers, payloads, strict=True)):
            page = pages[i * ALIGN : (i + 1) * ALIGN]
            page[:] = header  # `encode_object` pads it to the page
            buffers += [page, payload]
            if payload.nbytes % ALIGN:  # buffered only (`direct` is off): zeros to the next page
                buffers.append(_ZEROS[: -payload.nbytes % ALIGN])
        with self._lock:
            segment, offset = self._reserve(total)
            segment.users += 1
            self._fds.use(segment)  # the active segment's are open: this keeps them so
        written, error = pwrite_all(segment.fd_for(direct), buffers, offset)
        if error is None and self.fsync:
            try:
                os.fdatasync(segment.fd)
            except OSError as exc:
                written, error = 0, exc
        whole, kept = 0, 0  # the items written whole, and their bytes
        while whole < len(keys) and kept + sizes[whole] <= written:
            kept += sizes[whole]
            whole += 1
        if error is not None:
            with contextlib.suppress(OSError):  # else the range stays as garbage that recovery skips
                punch(segment.fd, offset + kept, total - kept)
        replaced = []
        with self._lock:
            at = offset
            for i in range(whole):
                new, old = Entry(segment, at, payloads[i].nbytes), self._map.get(keys[i])
                at += sizes[i]
                if moving is not None and old != moving[i]:  # deleted or stored again meanwhile
                    segment.users += 1
                    replaced.append(new)
                    continue
                if old is not None:
                    self._forget(old)
                    if moving is None:
                        old.segment.users += 1
                        replaced.append(old)
                self._map[keys[i]] = new
                segment.live += 1
                segment.live_bytes += sizes[i]
            self._fds.done(segment, self._active)
            self._release(segment)
        self._punch(replaced)
        return [None] * whole + [error] * (len(keys) - whole)

    def _reserve(self, nbytes: int) -> tuple[Segment, int]:
        """A range of `nbytes` at the active segment's tail, starting the next segment when the
        active one is full. Under the lock."""
        segment = self._active
        if segment is None or (segment.tail and segment.tail + nbytes > self.segment_bytes):
            segment = self._start_segment()
        offset = segment.tail
        segment.tail += nbytes
        return segment, offset

    def _start_segment(self) -> Segment:
        sequence = max(self._segments, default=0) + 1
        segment = self._fds.create(sequence)
        self._segments[sequence] = segment
        previous, self._active = self._active, segment
        if previous is not None:
            self._remove_if_done(previous)
        return segment

    # -- reads ------------------------------------------------------------------------------

    def get_many(self, items: Sequence[tuple[OffloadKey, memoryview]]) -> list[ObjectHeader | Exception]:
        """Read each item's entry into its buffer and check it: its header (key, layout),
        length and checksum or seal. Entries that lie side by side go in one vectored read."""
        self.recover()  # once: a store used before `recover` maps its segments first
        outcomes: list[ObjectHeader | Exception | None] = [None] * len(items)
        with self._lock:
            entries = [self._map.get(key) for key, _ in items]
            for entry in entries:
                if entry is not None:
                    entry.segment.users += 1
        try:
            readable: list[Entry | None] = []
            for i, ((key, into), entry) in enumerate(zip(items, entries, strict=True)):
                if entry is None:
                    outcomes[i] = ObjectNotFoundError(key)
                elif entry.payload_len != into.nbytes:
                    outcomes[i] = CorruptObjectError(
                        f"block {key.hex()}: {entry.payload_len} bytes, the row {into.nbytes}"
                    )
                readable.append(None if outcomes[i] else entry)
            for start, stop in runs(readable):
                outcomes[start:stop] = self._read_run(items[start:stop], readable[start:stop])
        finally:
            with self._lock:
                for entry in entries:
                    if entry is not None:
                        self._release(entry.segment)
        return outcomes  # type: ignore[return-value]

    def _read_run(self, items: Sequence[tuple[OffloadKey, memoryview]], run: list) -> list[ObjectHeader | Exception]:
        """Read the entries `run` (side by side in one segment, each the length of its item's
        buffer) into `items`' buffers in one vectored read, and check each."""
        intos = [into.cast("B") for _, into in items]
        direct = self.direct and all(is_aligned(into) for into in intos)
        pages = scratch_pages(len(run) + 1)
        sink = pages[len(run) * ALIGN :][:ALIGN]  # the padding after a payload that is not whole pages
        buffers: list[memoryview] = []
        for i, into in enumerate(intos):
            buffers += [pages[i * ALIGN : (i + 1) * ALIGN], into]
            if into.nbytes % ALIGN:
                buffers.append(sink[: -into.nbytes % ALIGN])
        first = run[0]
        try:
            with self._io(first.segment):
                received = pread_all(first.segment.fd_for(direct), buffers, first.offset)
        except OSError as exc:
            return [exc] * len(run)
        outcomes: list[ObjectHeader | Exception] = []
        for i, ((key, _), entry, into) in enumerate(zip(items, run, intos, strict=True)):
            try:
                if received < entry.offset - first.offset + entry.size:
                    raise CorruptObjectError(f"block {key.hex()}: its segment ends inside it")
                header = parse_header(pages[i * ALIGN : (i + 1) * ALIGN], self.fingerprint, key, self.seal)
                check_length(header, entry.payload_len, into.nbytes)
                verify_payload(header, into, self.seal)
                outcomes.append(header)
            except (CorruptObjectError, ForgedObjectError) as exc:
                outcomes.append(exc)
        return outcomes

    def exists(self, key: OffloadKey) -> bool:
        """Whether `key` has an entry (the map, no I/O). Any thread, the loop's among them: the
        lock is held for dict work and, rarely, a segment's open or unlink. False while the
        segments are being mapped (it never waits for that)."""
        if self.recovered is None:
            return False
        with self._lock:
            return key in self._map

    # -- deletes ----------------------------------------------------------------------------

    def delete_many(self, keys: Sequence[OffloadKey]) -> None:
        """Forget `keys` and punch their entries out of their segments (a segment left with
        none is removed once no call uses it). Keys not held are ignored.

        Raises:
            OSError: a punch failed (the keys are forgotten all the same).
        """
        self.recover()  # once: a store used before `recover` maps its segments first
        deleted = []
        with self._lock:
            for key in keys:
                if (entry := self._map.pop(key, None)) is not None:
                    entry.segment.users += 1
                    deleted.append(entry)
                    self._forget(entry)
        self._punch(deleted, raise_error=True)
        for segment in {entry.segment for entry in deleted}:
            self._compact_if_sparse(segment)

    def _compact_if_sparse(self, segment: Segment) -> None:
        """Copy the live entries of `segment`, byte for byte, to the active segment if they
        take less than 1/`SPARSE` of what it holds (and it is not the active one): it then
        empties and is removed, where one long-lived block would keep it for good. A failed
        copy is logged; the segment stays as it was."""
        with self._lock:
            if segment is self._active or not segment.live or segment.live_bytes * SPARSE >= segment.tail:
                return
            segment.users += 1
        try:
            with self._io(segment):
                found = list(walk(segment, self.fingerprint, self.seal, []))
                with self._lock:
                    live = [(key, entry) for key, entry, _ in found if self._map.get(key) == entry]
                raw = [memoryview(os.pread(segment.fd, entry.size, entry.offset)) for _, entry in live]
            pages = [image[:ALIGN] for image in raw]
            payloads = [image[ALIGN : ALIGN + entry.payload_len] for image, (_, entry) in zip(raw, live, strict=True)]
            self._append([key for key, _ in live], pages, payloads, [entry for _, entry in live])
        except OSError as exc:
            logger.warning("file tier: could not compact segment %s: %s", segment.name, exc)
        finally:
            with self._lock:
                self._release(segment)

    def _punch(self, entries: list[Entry], raise_error: bool = False) -> None:
        """Punch `entries` (forgotten, their segments' `users` counted for this call) out of
        their segments, then release the segments. With `raise_error`, the last error."""
        error: OSError | None = None
        for entry in entries:
            try:
                with self._io(entry.segment):
                    punch(entry.segment.fd, entry.offset, entry.size)
            except OSError as exc:
                error = exc
        with self._lock:
            for entry in entries:
                self._release(entry.segment)
        if error is not None and raise_error:
            raise error

    def _forget(self, entry: Entry | None) -> None:
        """`entry` is no longer listed: its segment holds one entry fewer. Under the lock."""
        if entry is not None:
            entry.segment.live -= 1
            entry.segment.live_bytes -= entry.size
            self._remove_if_done(entry.segment)

    def _release(self, segment: Segment) -> None:
        """A call that used `segment` ended. Under the lock."""
        segment.users -= 1
        self._remove_if_done(segment)

    def _remove_if_done(self, segment: Segment) -> None:
        """Unlink and close `segment` if it is not the active one, holds no entry and no call
        uses it. Under the lock (two system calls, as rare as a segment's end)."""
        if segment is self._active or segment.live or segment.users:
            return
        self._segments.pop(segment.sequence, None)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(segment.name, dir_fd=self.dir_fd)
        self._fds.forget(segment)

    @contextlib.contextmanager
    def _io(self, segment: Segment) -> Iterator[None]:
        """Keep `segment`'s descriptors open (opening them if closed) for the system calls
        in the block.

        Raises:
            OSError: they cannot be opened."""
        with self._lock:
            self._fds.use(segment)
        try:
            yield
        finally:
            with self._lock:
                self._fds.done(segment, self._active)

    # -- recovery and closing ---------------------------------------------------------------

    def recover(self) -> list[tuple[OffloadKey, int]]:
        """Map the entries the segments on disk hold (`segment_recovery.recover`), once;
        returns them, oldest first: (key, bytes of its object). Segments left with no entry
        are removed, and appends go to a new segment. Any thread; every other call waits for
        it (and makes it, if nobody has).

        Raises:
            OSError: a segment cannot be opened or read."""
        if self.recovered is not None:
            return self.recovered
        with self._recovering:
            if self.recovered is None:
                self.recovered = self._recover()
        return self.recovered

    def _recover(self) -> list[tuple[OffloadKey, int]]:
        progress = RecoveryProgress(f"file tier {self.path}")
        recovered = recover(self.dir_fd, self.fingerprint, self.seal, self._fds, progress)
        self.headers_rejected, self.unopened_reclaimed = recovered.headers_rejected, recovered.unopened_reclaimed
        with self._lock:
            self._segments, self._map = recovered.segments, recovered.found
            for segment in list(self._segments.values()):
                self._remove_if_done(segment)
        return [(key, ALIGN + entry.payload_len) for key, entry in self._map.items()]

    def close(self) -> None:
        """Close every segment and the directory; idempotent."""
        with self._lock:
            for segment in self._segments.values():
                self._fds.forget(segment)
            self._segments.clear()
            self._map.clear()
            self._active = None
            if self.dir_fd >= 0:
                os.close(self.dir_fd)  # releases the lock
                self.dir_fd = -1


def open_log(ns_fd: int, path: Path, fingerprint: bytes, seal: Seal | None, direct: bool, fsync: bool) -> SegmentLog:
    """Open (creating it 0700) the segments directory `path` under the namespace `ns_fd`, take
    its lock and check that its filesystem punches holes; the entries its segments hold are
    mapped by `SegmentLog.recover` (or the first call that needs them).

    Raises:
        BlockingIOError: another engine (or another tier of this one) uses these segments.
        OSError: the directory cannot be made or opened, or its filesystem cannot punch holes
            (EOPNOTSUPP; the message says so; a full device is not checked, and logged).
    """
    dir_fd = private_subdir(ns_fd, path.name, path)
    try:
        try:
            fcntl.flock(dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise BlockingIOError(
                errno.EWOULDBLOCK,
                f"{path} is in use by another engine: a namespace's segments are one engine's (use layout: files "
                "for a directory engines share)",
            ) from None
        if not probe_punch(dir_fd, path):
            logger.warning(
                "%s: the device is full: hole punching is not checked, and stores fail until it has room", path
            )
        log = SegmentLog(dir_fd, fingerprint, seal, direct, fsync)
    except BaseException:
        os.close(dir_fd)
        raise
    log.path = path
    return log
