"""`RowRecords`: what a CPU tier that outlives a crash (``cpu_tier: {survive_crash: true}``)
records of each row, so that an engine restarted after a crash adopts exactly the rows whose
blocks were committed, and nothing torn.

The records live in the engine's `SharedOffloadRegion`, after the rows' states: a header,
then one record per row.

- **The header** says whose rows these are: the format, the geometry (rows, row stride,
  bytes per row, workers) and the compatibility digest, ``namespace(identity, weights)``
  (`tiering.contract.identity.namespace`): an engine of another identity or other weights
  never adopts the region. A reset without a declared weight version writes a digest no
  engine has (zeros). It also holds when an engine start first found the region abandoned,
  for the sweep of regions nobody comes back for (`tiering.cpu.kept_regions.sweep`).
- **A record per row**: a version, the key of the block the row holds, and the row's XXH3-64
  checksum with the version it was computed at (``sealed``).

Who writes, in order:

1. Every free row has an odd version: at start every row not adopted is made odd, and the
   scheduler thread makes a row odd when its block is evicted or the tier is reset
   (`retract`), before the row can be reserved, so before any byte of it can be written
   again. A row whose version is odd holds nothing adoptable; a row that is reserved stays
   odd until its write is committed (a failed write leaves it odd and free).
2. When the write completed (vLLM reports a GPU store finished only once every worker's slot
   of the row is written; a promotion once the tier's read is checked), the scheduler thread
   makes the version even (`commit`) and queues the row, its version and its key for the
   sealer: two array writes per store, nothing per block.
3. The sealer, a thread of the scheduler's process, takes each committed row whose version is
   still the one queued: it writes the key, hashes the row, and, only if the version did not
   change meanwhile, writes the checksum and then ``sealed``, that version. Versions only
   grow, so a ``sealed`` written late for a version the row has left never matches it again,
   and the sealer handles the commits in order, so a row's key is that of its last sealed
   commit. A row committed but not yet sealed when the engine dies is not adopted (its
   block is recomputed or comes from a lasting tier).

A row is adopted only if its version is even and non-zero, ``sealed`` equals it, its key has
a length of 1 to `MAX_KEY_BYTES`, and the XXH3-64 of its bytes, computed again at adoption,
equals the checksum. Every other row is free. The stores of the records are plain stores to
shared memory, in program order (x86 keeps stores in order; a SIGKILL loses none already
made).

Thread: the scheduler thread, but `Sealer`'s own thread for the checksums.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import chain, compress

import numpy as np
import xxhash

from tiering.contract.identity import namespace
from tiering.contract.keys import OffloadKey
from tiering.stats import RareLog

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
VERIFY_THREADS = min(16, os.cpu_count() or 1)
"""Threads that check the rows found at adoption (their XXH3-64s), at most: a tier's size
divided by the hash's speed (about 12 GB/s a core here) is how long an engine's start waits."""
VERIFY_ROWS_PER_THREAD = 64  # rows a thread checks at least (fewer: one thread, no pool)
GIL_HELD_BYTES = 64 << 10  # XXH3 (`xxhash`) holds the GIL on buffers up to this size: one thread hashes them
SEALER_QUEUE = 4096
"""Committed batches waiting for the sealer at most; a batch beyond stays unsealed (logged rarely)."""

SEAL_EVERY_S = 0.01
"""How long the sealer lets commits gather after the first wakes it, seconds."""
row_checksum = xxhash.xxh3_64_intdigest
_ONE = np.uint64(1)


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
        """The header (`HEADER.size` bytes) of a region of this geometry and `digest` (16 bytes),
        first found abandoned at `abandoned_at` (wall-clock seconds; 0: not yet)."""
        fields = (self.num_blocks, self.row_stride, self.row_bytes, self.num_workers)
        return HEADER.pack(MAGIC, FORMAT, *fields, digest, abandoned_at)


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
        rows: the rows' memory, shape ``(num_blocks, row_stride)``, C-contiguous.
        row_bytes: the bytes of each row that hold its block (the rest is padding).
    """

    def __init__(self, header: memoryview, records: np.ndarray, rows: np.ndarray, row_bytes: int):
        self._header = header
        self.records = records
        self._memory = rows.reshape(-1).data  # a row is a slice of it: cheaper than an array's row
        self._stride, self._row_bytes = rows.shape[1], row_bytes
        self._version = records["version"]
        self.sealer: Sealer | None = None

    def checksum(self, row: int) -> int:
        """The XXH3-64 of row `row`'s bytes, now."""
        start = row * self._stride
        return row_checksum(self._memory[start : start + self._row_bytes])

    def release(self) -> None:
        """Let go of the region's memory (before it is unmapped)."""
        self._memory.release()

    def set_digest(self, digest: bytes) -> None:
        """Make `digest` (16 bytes; `NO_DIGEST`: adopted by none) the region's. Scheduler thread."""
        offset = HEADER.size - 16 - 8
        self._header[offset : offset + 16] = digest

    def retract(self, rows: Sequence[int] | np.ndarray) -> None:
        """Rows whose blocks are evicted: nothing in them is adoptable from now on, before any
        of them is reserved for another write. Scheduler thread."""
        self._version[np.asarray(rows, dtype=np.int64)] |= _ONE

    def retract_all(self) -> None:
        """Every row (a reset, or an adoption: every row not adopted). Scheduler thread."""
        self._version |= _ONE

    def commit(self, keys: list[OffloadKey], rows: Sequence[int]) -> None:
        """The writes of `keys` into `rows` completed: make each row's version even and queue
        it for the sealer, which records its key (`seal`). Scheduler thread; `keys` must not
        change afterwards."""
        index = np.asarray(rows, dtype=np.int64)
        committed = self._version[index] + _ONE  # odd (free, then reserved) to even
        self._version[index] = committed
        if self.sealer is not None:
            self.sealer.submit(index, committed, keys)

    def seal(self, rows: np.ndarray, versions: np.ndarray, keys: list[OffloadKey]) -> int:
        """Record the key and the checksum of each of `rows` still at its version in
        `versions` (`Sealer`'s thread); returns the rows sealed. A row evicted or written
        again meanwhile (its version changed before or while it was hashed), or whose key is
        longer than `MAX_KEY_BYTES`, is left unsealed."""
        lengths = np.fromiter(map(len, keys), dtype=np.uint64, count=len(keys))
        current = (self._version[rows] == versions) & (lengths <= MAX_KEY_BYTES)
        if not current.all():
            rows, versions, lengths = rows[current], versions[current], lengths[current]
            keys = list(compress(keys, current.tolist()))
        records = self.records
        records["key_len"][rows] = lengths
        if len(rows) and lengths.min() == lengths.max():  # the usual case: one length, no padding
            length = int(lengths[0])
            records["key"][rows, :length] = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(len(rows), length)
        elif len(rows):
            padded = b"".join(key.ljust(MAX_KEY_BYTES, b"\0") for key in keys)
            records["key"][rows] = np.frombuffer(padded, dtype=np.uint8).reshape(len(rows), MAX_KEY_BYTES)
        memory, size = self._memory, self._row_bytes
        starts = (rows * self._stride).tolist()
        checksums = np.array([row_checksum(memory[start : start + size]) for start in starts], dtype=np.uint64)
        unchanged = self._version[rows] == versions
        rows = rows[unchanged]
        records["checksum"][rows] = checksums[unchanged]
        records["sealed"][rows] = versions[unchanged]  # after the key and checksum: what says they are
        return len(rows)

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
        candidates = np.flatnonzero(ready).tolist()
        for row, checksum in zip(candidates, self._checksums(candidates), strict=True):
            length = int(lengths[row])
            key = records["key"][row, :length].tobytes() if 1 <= length <= MAX_KEY_BYTES else b""
            if not key or key in seen or checksum != int(records["checksum"][row]):
                found.corrupt += 1
                continue
            seen.add(key)
            found.keys.append(OffloadKey(key))
            found.rows.append(row)
        adopted = np.zeros(len(version), dtype=bool)
        adopted[found.rows] = True
        version[~adopted] |= _ONE  # every free row is odd from now on (a new region's too)
        return found

    def _checksums(self, rows: list[int]) -> list[int]:
        """`checksum` of each of `rows`, in order, hashed by up to `VERIFY_THREADS` threads at
        once, a contiguous share each, where the rows are larger than `GIL_HELD_BYTES`."""
        threads = min(VERIFY_THREADS, len(rows) // VERIFY_ROWS_PER_THREAD)
        if threads < 2 or self._row_bytes <= GIL_HELD_BYTES:
            return list(map(self.checksum, rows))
        shares = [rows[len(rows) * i // threads : len(rows) * (i + 1) // threads] for i in range(threads)]
        with ThreadPoolExecutor(threads, thread_name_prefix="tiering-adopt") as pool:
            return list(chain.from_iterable(pool.map(lambda share: list(map(self.checksum, share)), shares)))


class Sealer:
    """The thread that records committed rows (`RowRecords.seal`), in commit order, every
    batch waiting taken at once.

    Thread: `submit` from the scheduler thread (a deque's append and an event: no lock held
    for long); `drain` and `close` from the thread that stops the engine.
    """

    def __init__(self, records: RowRecords):
        self._records = records
        self._pending: deque[tuple[np.ndarray, np.ndarray, list[OffloadKey]] | None] = deque()
        self._wake = threading.Event()
        self._submitted = self._handled = 0  # batches (`_handled`: the sealer's thread writes it)
        self.rows_sealed = 0
        self._behind = RareLog()  # batches committed while `SEALER_QUEUE` waited: never adopted
        self._thread = threading.Thread(target=self._run, name="tiering-sealer", daemon=True)
        records.sealer = self
        self._thread.start()

    def submit(self, rows: np.ndarray, versions: np.ndarray, keys: list[OffloadKey]) -> None:
        """Queue `rows`, committed at `versions` with `keys`; never blocks."""
        if self._submitted - self._handled >= SEALER_QUEUE:
            self._behind.warning(
                logger,
                "the sealer is %d batches behind: %d committed rows left unsealed, not adoptable after a crash",
                SEALER_QUEUE,
                len(rows),
            )
            return
        self._submitted += 1
        self._pending.append((rows, versions, keys))
        self._wake.set()

    def drain(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` seconds for every queued row to be sealed; whether they were."""
        deadline = time.monotonic() + timeout_s
        while self._handled < self._submitted and time.monotonic() < deadline:
            time.sleep(0.001)
        return self._handled >= self._submitted

    def close(self) -> None:
        """Stop the thread (rows still queued stay unsealed)."""
        self._records.sealer = None
        self._pending.append(None)
        self._wake.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            time.sleep(SEAL_EVERY_S)  # the commits of a few steps at once: fewer calls per row
            self._wake.clear()  # before the queue is emptied: a batch queued later wakes it again
            batches = []
            while self._pending:
                batches.append(self._pending.popleft())
            work = [batch for batch in batches if batch is not None]
            try:
                if work:
                    rows, versions = (np.concatenate([batch[i] for batch in work]) for i in (0, 1))
                    keys = [key for batch in work for key in batch[2]]
                    self.rows_sealed += self._records.seal(rows, versions, keys)
            except Exception:  # a bug here must not stop the sealing of later rows
                logger.exception("sealing committed rows failed; they will not be adopted")
            finally:
                self._handled += len(work)
            if len(work) < len(batches):
                return
