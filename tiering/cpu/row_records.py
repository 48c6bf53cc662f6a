"""`RowRecords`: what a CPU tier that outlives a crash (``cpu_tier: {survive_crash: true}``)
records of each row, so that an engine restarted after a crash adopts exactly the rows whose
blocks were committed, and nothing torn.

The records live in the engine's `SharedOffloadRegion`, after the rows' states: a header,
then one record per row.

- **The header** says whose rows these are: the format, the geometry (rows, row stride,
  bytes per row, workers) and the compatibility digest, ``namespace(identity, weights)``
  (`tiering.contract.identity.namespace`): an engine of another identity or other weights
  never adopts the region. A reset without a declared weight version writes a digest no
  engine has (zeros). It also holds when an engine start first found the region abandoned
  (`stamp_abandoned`), for the sweep of regions nobody comes back for.
- **A record per row**: a version, the key of the block the row holds, and the row's XXH3-64
  checksum with the version it was computed at (``sealed``).

Who writes, in order (the scheduler thread, but for the sealer):

1. A row reserved for a write, or freed, gets an odd version (`retract`) before any byte of
   it can be written again: a row whose version is odd holds nothing adoptable.
2. A write that completed (vLLM reports a GPU store finished only once every worker's slot
   of the row is written; a promotion once the tier's read is checked) writes the key, then
   makes the version even (`commit`), and queues the row for the sealer.
3. The sealer, a thread of the scheduler's process, hashes each committed row: it reads the
   version, hashes the row, reads the version again, and only if it did not change writes
   the checksum, then ``sealed`` (a row evicted meanwhile is skipped). It runs off the
   scheduler's hot path; a row committed but not yet sealed when the engine dies is not
   adopted (its block is recomputed or comes from a lasting tier).

A row is adopted only if its version is even and non-zero, ``sealed`` equals it, its key has
a length of 1 to `MAX_KEY_BYTES`, and the XXH3-64 of its bytes, computed again at adoption,
equals the checksum. Every other row is free. The stores of the records are plain stores to
shared memory, in program order (x86 keeps stores in order; a SIGKILL loses none already
made).

Thread: the scheduler thread, but `Sealer`'s own thread for the checksums.
"""

from __future__ import annotations

import logging
import queue
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from tiering.contract.identity import namespace
from tiering.contract.keys import OffloadKey

logger = logging.getLogger(__name__)

MAGIC = b"KVTKEPT\x00"
FORMAT = 1
MAX_KEY_BYTES = 64
"""The longest key a record holds (vLLM's are a 32-byte hash and 4 bytes); a longer one's row
is never adopted."""
HEADER = struct.Struct("<8sIQQQQ16sd")  # magic, format, rows, row stride, row bytes, workers, digest, abandoned at
HEADER_BYTES = 4096
RECORD = np.dtype(
    [("version", "<u8"), ("sealed", "<u8"), ("checksum", "<u8"), ("key_len", "<u8"), ("key", "u1", (MAX_KEY_BYTES,))]
)
NO_DIGEST = bytes(16)
"""The digest of a region no engine may adopt (a reset without a declared weight version)."""
SEALER_QUEUE = 4096
"""Committed batches waiting for the sealer; a batch that finds it full stays unsealed (counted)."""

row_checksum = xxhash.xxh3_64_intdigest


@dataclass(frozen=True)
class Survival:
    """How a primary tier outlives its engine (``cpu_tier``): `identity_digest`, with the weights
    in force, gives the region's compatibility digest (`digest`); `keep_on_stop`: a graceful
    stop leaves the region to the next engine too, after sealing what was committed."""

    identity_digest: bytes
    keep_on_stop: bool = True

    def digest(self, weights: str | None) -> bytes:
        """The compatibility digest of the rows computed with `weights` (a declared version or
        `CHECKPOINT`; None: weights no other engine can know, so `NO_DIGEST`)."""
        return NO_DIGEST if weights is None else namespace(self.identity_digest, weights)


@dataclass(frozen=True)
class Geometry:
    """What a region must match to be adopted, besides its digest."""

    num_blocks: int
    row_stride: int
    row_bytes: int
    num_workers: int

    def header(self, digest: bytes, abandoned_at: float = 0.0) -> bytes:
        """The header of a region of this geometry and `digest` (16 bytes)."""
        fields = (self.num_blocks, self.row_stride, self.row_bytes, self.num_workers)
        return HEADER.pack(MAGIC, FORMAT, *fields, digest, abandoned_at)

    def records_bytes(self) -> int:
        """Bytes of the header and the records, before page padding."""
        return HEADER_BYTES + self.num_blocks * RECORD.itemsize


@dataclass(frozen=True)
class Header:
    """A region's header as read back (`read_header`)."""

    geometry: Geometry | None  # None: not a kept region of this format (a torn or foreign header)
    digest: bytes
    abandoned_at: float


def read_header(data: bytes) -> Header:
    """Parse the first `HEADER.size` bytes of a records area; a wrong magic or format gives
    a `Header` without geometry. Raises nothing."""
    if len(data) < HEADER.size:
        return Header(None, NO_DIGEST, 0.0)
    magic, fmt, rows, stride, row_bytes, workers, digest, abandoned_at = HEADER.unpack_from(data)
    if magic != MAGIC or fmt != FORMAT:
        return Header(None, NO_DIGEST, 0.0)
    return Header(Geometry(rows, stride, row_bytes, workers), digest, abandoned_at)


@dataclass
class Adoption:
    """What `RowRecords.adopt` found: the blocks adopted, and the rows not, by reason."""

    keys: list[OffloadKey]
    rows: list[int]
    uncommitted: int = 0  # written, being written or freed when the engine died
    unsealed: int = 0  # committed, but not hashed yet
    corrupt: int = 0  # a key or checksum that does not match the row: never served


class RowRecords:
    """The header and the per-row records of a region (see the module docstring).

    Args:
        header: the header's bytes in the region (a writable buffer of `HEADER_BYTES`).
        records: the records, a `RECORD` array of one per row, in the region.
        rows: the rows, shape ``(num_blocks, row_bytes)`` (the scheduler's view).
    """

    def __init__(self, header: memoryview, records: np.ndarray, rows: np.ndarray):
        self._header = header
        self.records = records
        self._rows = rows
        self._version = records["version"]
        self.sealer: Sealer | None = None

    def set_digest(self, digest: bytes) -> None:
        """Make `digest` (16 bytes; `NO_DIGEST`: adopted by none) the region's. Scheduler thread."""
        offset = HEADER.size - 16 - 8
        self._header[offset : offset + 16] = digest

    def retract(self, rows: Sequence[int] | np.ndarray) -> None:
        """Rows reserved for a write or freed: nothing in them is adoptable from now on."""
        self._version[np.asarray(rows, dtype=np.int64)] |= np.uint64(1)

    def retract_all(self) -> None:
        """Every row (a reset)."""
        self._version |= np.uint64(1)

    def commit(self, keys: Sequence[OffloadKey], rows: Sequence[int]) -> None:
        """The writes of `keys` into `rows` completed: record each key, then make its row's
        version even, and queue the rows for the sealer. A key longer than `MAX_KEY_BYTES`
        leaves its row odd."""
        index = np.asarray(rows, dtype=np.int64)
        lengths = np.fromiter(map(len, keys), dtype=np.uint64, count=len(keys))
        fits = lengths <= MAX_KEY_BYTES
        if not fits.all():
            index, lengths = index[fits], lengths[fits]
            keys = [key for key, ok in zip(keys, fits.tolist(), strict=True) if ok]
        records = self.records
        padded = b"".join(key.ljust(MAX_KEY_BYTES, b"\0") for key in keys)
        records["key"][index] = np.frombuffer(padded, dtype=np.uint8).reshape(len(index), MAX_KEY_BYTES)
        records["key_len"][index] = lengths
        self._version[index] += np.uint64(1)  # odd (reserved) to even (committed)
        if self.sealer is not None:
            self.sealer.submit(index, self._version[index])

    def seal(self, rows: np.ndarray, versions: np.ndarray) -> int:
        """Hash each of `rows` still at its version in `versions` and record it (`Sealer`'s
        thread); returns the rows sealed."""
        records, version, sealed = self.records, self._version, 0
        for row, expected in zip(rows.tolist(), versions.tolist(), strict=True):
            if int(version[row]) != expected:
                continue  # evicted or written again since
            checksum = row_checksum(self._rows[row])
            if int(version[row]) != expected:
                continue
            records["checksum"][row] = checksum
            records["sealed"][row] = expected
            sealed += 1
        return sealed

    def adopt(self) -> Adoption:
        """Find the rows a dead engine committed and sealed, each checked against its
        checksum (see the module docstring); every other row is retracted. Scheduler
        thread, at start, before any row is written."""
        records = self.records
        version, sealed, lengths = self._version, records["sealed"], records["key_len"]
        committed = (version & np.uint64(1) == 0) & (version != 0)
        ready = committed & (sealed == version)
        found = Adoption([], [], uncommitted=int(((version != 0) & ~committed).sum()))
        found.unsealed = int((committed & ~ready).sum())
        seen: set[bytes] = set()
        for row in np.flatnonzero(ready).tolist():
            length = int(lengths[row])
            key = records["key"][row, :length].tobytes() if 1 <= length <= MAX_KEY_BYTES else b""
            if not key or key in seen or row_checksum(self._rows[row]) != int(records["checksum"][row]):
                found.corrupt += 1
                continue
            seen.add(key)
            found.keys.append(OffloadKey(key))
            found.rows.append(row)
        adopted = np.zeros(len(version), dtype=bool)
        adopted[found.rows] = True
        version[~adopted & (version != 0)] |= np.uint64(1)
        return found


class Sealer:
    """The thread that hashes committed rows (`RowRecords.seal`), in commit order.

    Thread: `submit` from the scheduler thread; `drain` and `close` from the thread that
    stops the engine.
    """

    def __init__(self, records: RowRecords):
        self._records = records
        self._queue: queue.Queue[tuple[np.ndarray, np.ndarray] | None] = queue.Queue(SEALER_QUEUE)
        self.rows_sealed = 0
        self.rows_unsealed = 0  # committed while the queue was full: never adopted
        self._thread = threading.Thread(target=self._run, name="tiering-sealer", daemon=True)
        records.sealer = self
        self._thread.start()

    def submit(self, rows: np.ndarray, versions: np.ndarray) -> None:
        """Queue `rows`, committed at `versions`; never blocks."""
        try:
            self._queue.put_nowait((rows, versions))
        except queue.Full:
            self.rows_unsealed += len(rows)

    def drain(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` seconds for every queued row to be sealed; whether they were."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.001)
        return not self._queue.unfinished_tasks

    def close(self) -> None:
        """Stop the thread (rows still queued stay unsealed)."""
        self._records.sealer = None
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (batch := self._queue.get()) is not None:
            try:
                self.rows_sealed += self._records.seal(*batch)
            except Exception:  # a bug here must not stop the sealing of later rows
                logger.exception("sealing %d committed rows failed; they will not be adopted", len(batch[0]))
            finally:
                self._queue.task_done()
        self._queue.task_done()
