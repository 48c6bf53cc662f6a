"""`SharedOffloadRegion`: the primary tier's rows in one shared-memory file.

The scheduler process and every worker process map the same file. Row ``b`` holds worker
0's slot of block ``b``, then worker 1's, ...; each row starts on a page boundary (so a row
can be the buffer of an O_DIRECT read or write), and any padding after a row is invisible
in the views handed out. After the rows, one byte per row says whether a promotion into it
has landed (`tiering.cpu.row_states`).

Lifecycle, safe against races and crashes:

- The first process to arrive creates the file: it sizes a private temporary file, takes a
  shared `flock` on it, and `link`s it to the region's name. `link` fails if the name
  exists, so exactly one process wins, and a file visible under the name is always
  full-sized (joiners never wait for it to grow).
- Every process that maps the region holds a shared `flock` for as long as it does. A file
  under the name that nobody holds a lock on is a leftover of a crashed run: the next
  process takes an exclusive lock on it, unlinks it and creates a fresh one, whatever its
  size was.
- A live region of another size is an error, never silently reused.
- Each role is held by one engine at a time: the scheduler side (rank None) and each worker
  rank take an open-file-description lock on their own byte of the file for as long as they
  map it. A second engine started with a live engine's instance id is refused with
  `RegionInUseError`, instead of both overwriting each other's rows; the lock dies with its
  process, so a crashed engine's id is free again at once.
- The creator allocates the whole file up front (`posix_fallocate`): a region larger than
  the free shared memory fails at start with ENOSPC, never with SIGBUS mid-run.
- Once the scheduler side and every worker rank map the region, whichever attached last
  removes its name. The memory then lives exactly as long as some process maps it, however
  the processes end (vLLM force-kills its engine process on a stop, and SIGKILL runs no
  cleanup). Only the start-up window, before every role has attached, can leave a file
  behind; every engine start sweeps such leftovers (`remove_stale`), whatever their id.
  A process that arrives after the name is gone makes a region of its own: an engine is
  expected to start its processes together, as vLLM does.
- `cleanup()` unmaps and closes; the creator also unlinks the file if the name is still
  its own.
- A region made to outlive its engine (`keep`: ``cpu_tier: {survive_crash: true}``) also holds
  the rows' records (`tiering.cpu.row_records`), with its header in the file's last page.
  Once every role has attached, its name is not removed but exchanged for a kept one, and a
  later engine of the same geometry and compatibility digest claims it instead of creating a
  region (`tiering.cpu.kept_regions`).

Thread: the thread that builds the engine (scheduler process) or a worker (worker
process) creates and cleans it up; the rows themselves are read and written by the
handlers' copy threads and the tiers' I/O.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import mmap
import os
import re
from pathlib import Path

import numpy as np

from tiering.cpu import kept_regions
from tiering.cpu.region_locks import hold_role, is_current, role_held, take_abandoned
from tiering.cpu.row_records import HEADER_BYTES, RECORD, Geometry, RowRecords
from tiering.cpu.row_states import RowStates
from tiering.errors import RegionInUseError

logger = logging.getLogger(__name__)

_SAFE_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def region_path(instance_id: str, shm_dir: str | os.PathLike = "/dev/shm") -> Path:
    """Path of the file behind the region of `instance_id` (ids outside ``[A-Za-z0-9_.-]{1,64}``
    are hashed)."""
    name = instance_id if _SAFE_ID.fullmatch(instance_id) else hashlib.sha256(instance_id.encode()).hexdigest()[:32]
    return Path(shm_dir) / f"tiering-{name}.kv"


class SharedOffloadRegion:
    """CPU rows for `num_blocks` blocks, shared by the scheduler and `num_workers` workers.

    Attributes:
        path: the shared-memory file.
        row_bytes: bytes of one block (all workers' slots): ``num_workers * cpu_page_size``.
        row_stride: distance in bytes between two rows, `row_bytes` rounded up to a page.
        is_creator: whether this object created (and will unlink) the file.
        keep: the compatibility digest of a region made to outlive its engine, or None.
    """

    def __init__(
        self,
        instance_id: str,
        num_blocks: int,
        cpu_page_size: int,
        num_workers: int = 1,
        rank: int | None = None,
        shm_dir: str | os.PathLike = "/dev/shm",
        keep: bytes | None = None,
    ):
        """Create the region's file, claim a kept one, or join the live one.

        Args:
            instance_id: names the file; every process of one engine passes the same id.
            num_blocks: rows (blocks), > 0.
            cpu_page_size: bytes of one worker's slot of a row, > 0.
            num_workers: slots per row (tensor-parallel world size), > 0.
            rank: this worker's slot, or None on the scheduler side.
            shm_dir: directory of the file; a tmpfs such as /dev/shm.
            keep: with a compatibility digest (16 bytes: `tiering.contract.identity.namespace`),
                the region outlives its engine, and a dead engine's region of this digest
                and geometry is adopted; None: it dies with the engine.

        Raises:
            ValueError: a size or the rank is out of range, or a live region with this id
                has another size.
            RegionInUseError: a live engine with this instance id already holds this role.
            OSError: the file cannot be created or mapped; ENOSPC: the free shared memory
                in `shm_dir` is smaller than the region (the message gives both sizes).
        """
        if num_blocks < 1 or cpu_page_size < 1 or num_workers < 1:
            raise ValueError(
                f"num_blocks, cpu_page_size and num_workers must be positive, "
                f"got {num_blocks}, {cpu_page_size}, {num_workers}"
            )
        if rank is not None and not 0 <= rank < num_workers:
            raise ValueError(f"rank {rank} is outside 0..{num_workers - 1}")
        self.num_blocks = num_blocks
        self.cpu_page_size = cpu_page_size
        self.num_workers = num_workers
        self.rank = rank
        self.row_bytes = num_workers * cpu_page_size
        self.row_stride = -(-self.row_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
        self.path = region_path(instance_id, shm_dir)
        self._next_view_offset = 0
        self.instance_id = instance_id
        self.keep = keep
        self.geometry = Geometry(num_blocks, self.row_stride, self.row_bytes, num_workers)
        self._role = 0 if rank is None else 1 + rank
        self._fd, self.is_creator = self._open()
        try:
            self._hold_role()
            self._mmap: mmap.mmap | None = mmap.mmap(self._fd, self.total_size_bytes)
        except BaseException:
            self._release_file()
            raise
        rows_bytes = num_blocks * self.row_stride
        self._rows = np.frombuffer(self._mmap, dtype=np.int8, count=rows_bytes).reshape(num_blocks, self.row_stride)
        self._store_failures = np.frombuffer(self._mmap, dtype=np.uint64, count=num_workers, offset=rows_bytes)
        self._states = np.frombuffer(self._mmap, dtype=np.uint8, count=num_blocks, offset=rows_bytes + 8 * num_workers)
        records_at = rows_bytes + self._states_bytes
        self._records = np.frombuffer(self._mmap, dtype=RECORD, count=num_blocks, offset=records_at) if keep else None
        self._header = memoryview(self._mmap)[self.total_size_bytes - HEADER_BYTES :] if keep else None
        self._unlink_once_all_attached()

    @property
    def address(self) -> int:
        """Address of the mapping in this process (for `cudaHostRegister`)."""
        return self._rows.ctypes.data

    @property
    def total_size_bytes(self) -> int:
        """Size of the file: ``num_blocks * row_stride``, then the rows' states
        (`create_row_states`: a count of failed GPU stores per worker, 8 bytes each, then a
        byte per row), padded to a page; with `keep`, then the rows' records, padded to a
        page, and their header's page."""
        size = self.num_blocks * self.row_stride + self._states_bytes
        if self.keep is not None:
            size += _pages(self.num_blocks * RECORD.itemsize) + HEADER_BYTES
        return size

    @property
    def _states_bytes(self) -> int:
        return _pages(8 * self.num_workers + self.num_blocks)

    def create_kv_memoryview(self) -> memoryview:
        """The scheduler's view: every row, shape ``(num_blocks, row_bytes)``, format ``b``.

        Row ``b`` is ``np.asarray(view)[b]``. The view is strided when `row_bytes` is not a
        multiple of the page size.
        """
        return self._rows[:, : self.row_bytes].data

    def create_row_states(self) -> RowStates:
        """The rows' states (`tiering.cpu.row_states`), one byte per row, and each worker's count
        of rows its failed GPU stores marked, shared by every process that maps the region;
        all ``READY`` and 0 in a new region. A worker rank's `RowStates` counts into its own."""
        return RowStates(self._states, self._store_failures, self.rank or 0)

    def create_row_records(self) -> RowRecords | None:
        """The rows' records and their header (`tiering.cpu.row_records`), over the
        scheduler's view of the rows; None where the region is not kept."""
        if self._header is None or self._records is None:
            return None
        return RowRecords(self._header, self._records, self._rows, self.row_bytes)

    def drop_kept(self) -> None:
        """Remove the kept name of this region, if it has one: no engine adopts it after
        this one (a graceful stop that does not keep it). Raises nothing."""
        for path in self.path.parent.glob(f"tiering-*{kept_regions.KEPT_SUFFIX}"):
            if self._mmap is not None and is_current(path, self._fd):
                try:
                    path.unlink(missing_ok=True)
                except OSError as exc:
                    logger.warning("%s: cannot drop the kept region (%s)", path, exc)
                    continue
                logger.info("%s: the kept region is dropped", path)

    def create_next_view(self, page_bytes: int) -> np.ndarray:
        """Carve the next `page_bytes` of this worker's slot out of every row.

        Successive calls return successive, non-overlapping pieces of the slot (one per KV
        tensor, say). Returns an int8 array of shape ``(num_blocks, page_bytes)`` whose rows
        are ``row_stride`` bytes apart.

        Raises:
            ValueError: on the scheduler side (rank None), or the pieces would outgrow the
                slot's `cpu_page_size` bytes.
        """
        if self.rank is None:
            raise ValueError("create_next_view needs a worker rank; the scheduler side has none")
        start = self._next_view_offset
        if page_bytes < 1 or start + page_bytes > self.cpu_page_size:
            raise ValueError(
                f"a view of {page_bytes} bytes at offset {start} does not fit a slot of {self.cpu_page_size} bytes"
            )
        self._next_view_offset = start + page_bytes
        base = self.rank * self.cpu_page_size + start
        return self._rows[:, base : base + page_bytes]

    def cleanup(self) -> None:
        """Unmap and close; the creator also unlinks the file. Later calls do nothing.

        Arrays handed out stay valid until they are dropped: the mapping is closed only
        once nothing exports it, otherwise it goes with the last array.
        """
        if self._mmap is None:
            return
        mapping, self._mmap = self._mmap, None
        if self._header is not None:
            self._header.release()
        del self._rows, self._states, self._store_failures, self._records  # the mapping closes once none exports it
        try:
            mapping.close()
        except BufferError:
            logger.debug("%s: views still exported; the mapping goes with the last one", self.path)
        self._release_file()

    def _release_file(self) -> None:
        if self.is_creator:
            try:
                if os.stat(self.path).st_ino == os.fstat(self._fd).st_ino:
                    os.unlink(self.path)
            except FileNotFoundError:
                pass
        os.close(self._fd)

    def _open(self) -> tuple[int, bool]:
        """Return (fd holding a shared lock on the live file, created or claimed by us)."""
        while True:
            if self.keep is not None:
                fd = kept_regions.claim(self.path.parent, self.geometry, self.keep, self.path, self._role)
                if fd is not None:
                    return fd, True
            fd = self._try_create()
            if fd is not None:
                return fd, True
            fd = self._try_join()
            if fd is not None:
                return fd, False

    def _unlink_once_all_attached(self) -> None:
        """Remove the file's name (or, kept, exchange it for a kept one) if every other role
        is held too (see the module docstring)."""
        for role in range(1 + self.num_workers):
            if role != self._role and not role_held(self._fd, role):
                return
        try:
            if self.keep is not None:
                kept = kept_regions.keep(self.path, self._fd)
                if kept is not None:
                    logger.info("%s: every process attached; kept as %s", self.path, kept.name)
            elif is_current(self.path, self._fd):
                os.unlink(self.path)
                logger.debug("%s: every process attached; the name is removed", self.path)
        except FileNotFoundError:
            return
        except OSError as exc:  # not kept: a crash loses the rows, as without survive_crash
            logger.warning("%s: cannot keep the region for after a crash (%s)", self.path, exc)

    def _hold_role(self) -> None:
        """Lock this role's byte of the file (see the module docstring)."""
        if not hold_role(self._fd, self._role):
            who = "a scheduler" if self.rank is None else f"worker rank {self.rank}"
            raise RegionInUseError(
                f"shared region {self.path}: a live engine with instance id {self.instance_id!r} already has "
                f"{who} attached; give each engine its own instance id"
            ) from None

    def _try_create(self) -> int | None:
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            self._allocate(fd)
            if self.keep is not None:
                os.pwrite(fd, self.geometry.header(self.keep), self.total_size_bytes - HEADER_BYTES)
            os.link(tmp, self.path)
        except FileExistsError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        finally:
            os.unlink(tmp)
        return fd

    def _allocate(self, fd: int) -> None:
        info = os.statvfs(self.path.parent)
        free = info.f_bavail * info.f_frsize
        try:
            if self.total_size_bytes > free:
                raise OSError(errno.ENOSPC, "")
            os.posix_fallocate(fd, 0, self.total_size_bytes)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                raise
            raise OSError(
                errno.ENOSPC,
                f"shared region {self.path} needs {self.total_size_bytes} bytes; {self.path.parent} has "
                f"{free} free: lower cpu_bytes_to_use or enlarge {self.path.parent}",
            ) from None

    def _try_join(self) -> int | None:
        """Join the file under the name; None if it vanished or was a leftover (now removed)."""
        try:
            fd = os.open(self.path, os.O_RDWR)
        except FileNotFoundError:
            return None
        if _unlink_if_abandoned(self.path, fd):
            os.close(fd)
            return None
        fcntl.flock(fd, fcntl.LOCK_SH)
        if not is_current(self.path, fd):
            os.close(fd)
            return None
        size = os.fstat(fd).st_size
        if size != self.total_size_bytes:
            os.close(fd)
            raise ValueError(
                f"shared region {self.path} is live with {size} bytes; this engine needs "
                f"{self.total_size_bytes} ({self.num_blocks} rows of {self.row_stride} bytes, and their states): "
                "another engine uses the same instance id"
            )
        return fd

    @staticmethod
    def remove_stale(prefix: str = "", shm_dir: str | os.PathLike = "/dev/shm") -> list[Path]:
        """Remove the files of regions whose instance id starts with `prefix` (every region
        by default) and that no live process maps: leftovers of runs killed before all their
        processes attached, whose ids will not come again; and sweep the kept regions nobody
        came back for (`tiering.cpu.kept_regions.sweep`). Returns the removed paths.

        Raises:
            ValueError: `prefix` is not made of ``[A-Za-z0-9_.-]``.
        """
        if prefix and not _SAFE_ID.fullmatch(prefix):
            raise ValueError(f"prefix {prefix!r} must be made of letters, digits, '_', '.' and '-'")
        removed = []
        for path in Path(shm_dir).glob(f"tiering-{prefix}*.kv"):
            try:
                fd = os.open(path, os.O_RDWR)
            except OSError:  # gone meanwhile, or another user's (every engine start sweeps)
                continue
            try:
                if _unlink_if_abandoned(path, fd):
                    removed.append(path)
            finally:
                os.close(fd)
        return removed + kept_regions.sweep(Path(shm_dir))


def _pages(size: int) -> int:
    return -(-size // mmap.PAGESIZE) * mmap.PAGESIZE


def _unlink_if_abandoned(path: Path, fd: int) -> bool:
    """If no process holds a lock on `fd`'s file, it is a crashed run's leftover: unlink it
    and return True, keeping an exclusive lock until `fd` closes."""
    if not take_abandoned(path, fd):
        return False  # a live process holds it
    logger.warning("%s: removing a leftover region of a crashed run", path)
    os.unlink(path)
    return True
