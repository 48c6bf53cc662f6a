"""The ``file`` tier: one file per block under a directory, written atomically.

Layout: ``<root_dir>/<layout fingerprint hex>/<shard>/<key hex>``, where the shard is the
first byte (hex) of a hash of the key, 256 shards. Names are hex, so no key can escape the
directory. Directories are 0700, files 0600.

I/O bypasses the page cache with O_DIRECT by default (``direct_io``): buffered writes would
keep a second copy of every block in RAM, competing with the primary tier. Headers are
padded to 4096 bytes so payloads stay aligned; a filesystem that refuses O_DIRECT (probed
at open) falls back to buffered I/O with one log line, and a row that is not page-aligned
is moved buffered. Files are the same in both modes.

Each operation (or batch) is one function run in one hop on the tier's own thread pool
(`aiofiles.os.wrap`): open, vectored write or read, close, rename, CRC, all in the worker
thread, so a block costs one executor hop instead of one per system call. Writes go to a
temporary name and are renamed into place (optionally after `fsync`), so a crash leaves a
whole object or a temporary file that the next start removes. A thread already running an
operation is never abandoned: the await is shielded from cancellation, so a load never
reports while its thread may still write into the primary row.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import mmap
import os
import threading
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import aiofiles.os
import anyio
import numpy as np

from backends.store import BlockStore
from tiering.async_tier import BlockStoreTier
from tiering.errors import CorruptObjectError, ObjectNotFoundError
from tiering.keys import OffloadKey
from tiering.object_format import ObjectHeader, check_length, encode_header, header_size, parse_header

logger = logging.getLogger(f"tiering.{__name__}")  # one logger tree: "tiering"

T = TypeVar("T")
_TMP_SUFFIX = ".tmp"
_SHARDS = [f"{i:02x}" for i in range(256)]
_ALIGN = 4096  # O_DIRECT alignment of buffers, lengths and offsets
_thread_local = threading.local()


class FileBlockStore(BlockStore):
    """Objects as files under ``root_dir/<fingerprint>``.

    Args:
        root_dir: the tier's directory (created 0700 if missing).
        fingerprint: the layout fingerprint; it names the namespace directory.
        io_threads: threads of the store's pool, that is block operations run at once.
        fsync: `fsync` each file before renaming it into place (durable across power loss).
        direct_io: use O_DIRECT where the filesystem supports it.
    """

    header_align = _ALIGN

    def __init__(
        self,
        root_dir: str | os.PathLike,
        fingerprint: bytes,
        io_threads: int = 16,
        fsync: bool = False,
        direct_io: bool = True,
    ):
        super().__init__(fingerprint)
        if io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {io_threads}")
        self.directory = Path(root_dir) / fingerprint.hex()
        self.fsync = fsync
        self.direct_io = direct_io
        self._io_threads = io_threads
        self._pool: ThreadPoolExecutor | None = None

    def path(self, key: OffloadKey) -> Path:
        """The file of `key`."""
        shard = hashlib.blake2b(key, digest_size=1).hexdigest()
        return self.directory / shard / key.hex()

    async def _run(self, func: Callable[..., T], *args: Any) -> T:
        self.check_open()
        with anyio.CancelScope(shield=True):
            return await aiofiles.os.wrap(func)(*args, executor=self._pool)

    async def open(self) -> None:
        """Create the namespace and shard directories.

        Raises:
            PermissionError, OSError: `root_dir` cannot be created or written (message names it).
        """
        self._pool = ThreadPoolExecutor(self._io_threads, thread_name_prefix="tiering-file")
        await super().open()
        try:
            await self._run(_make_directories, self.directory)
            if self.direct_io and not await self._run(_supports_direct_io, self.directory):
                logger.warning("file tier %s: O_DIRECT is not supported here; using buffered I/O", self.directory)
                self.direct_io = False
        except OSError as exc:
            await self.close()
            raise type(exc)(exc.errno, f"file tier: cannot use {self.directory}: {exc.strerror}") from exc

    async def close(self) -> None:
        await super().close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    async def put(self, key: OffloadKey, payload: memoryview) -> None:
        await self._run(_write_object, self.path(key), key, payload, self.fingerprint, self.fsync, self.direct_io)

    async def get(self, key: OffloadKey, into: memoryview) -> ObjectHeader:
        return await self._run(_read_object, self.path(key), key, into, self.fingerprint, self.direct_io)

    async def put_many(self, items: Sequence[tuple[OffloadKey, memoryview]]) -> list[Exception | None]:
        """All puts in one hop, one after the other in one pool thread."""
        calls = [(self.path(key), key, data, self.fingerprint, self.fsync, self.direct_io) for key, data in items]
        return await self._run(_each, _write_object, calls)

    async def get_many(self, items: Sequence[tuple[OffloadKey, memoryview]]) -> list[ObjectHeader | Exception]:
        """All gets in one hop, one after the other in one pool thread."""
        calls = [(self.path(key), key, into, self.fingerprint, self.direct_io) for key, into in items]
        return await self._run(_each, _read_object, calls)

    async def exists(self, key: OffloadKey) -> bool:
        return await self._run(os.path.exists, self.path(key))

    async def delete_many(self, keys: Collection[OffloadKey]) -> None:
        await self._run(_unlink_all, [self.path(key) for key in keys])

    async def recover(self) -> list[tuple[OffloadKey, int]]:
        return await self._run(_scan, self.directory, self.fingerprint)


def _each(func: Callable[..., Any], calls: list[tuple]) -> list[Any]:
    """func(*args) for each call: its result, or the exception it raised."""
    outcomes: list[Any] = []
    for args in calls:
        try:
            outcomes.append(func(*args))
        except Exception as exc:
            outcomes.append(exc)
    return outcomes


def _make_directories(directory: Path) -> None:
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    for shard in _SHARDS:
        (directory / shard).mkdir(mode=0o700, exist_ok=True)
    if not os.access(directory, os.W_OK | os.X_OK):
        raise PermissionError(13, "not writable")


def _supports_direct_io(directory: Path) -> bool:
    probe = directory / f".direct-probe-{os.urandom(4).hex()}{_TMP_SUFFIX}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    except OSError:
        return False
    os.close(fd)
    os.unlink(probe)
    return True


def _is_aligned(buffer: memoryview) -> bool:
    return buffer.nbytes % _ALIGN == 0 and np.frombuffer(buffer, dtype=np.uint8).ctypes.data % _ALIGN == 0


def _header_buffer(header: bytes | None, direct: bool) -> memoryview:
    """A buffer for a header: this thread's page-aligned scratch page under O_DIRECT."""
    if not direct:
        return memoryview(bytearray(header or _ALIGN))
    page = getattr(_thread_local, "page", None)
    if page is None:
        page = _thread_local.page = mmap.mmap(-1, _ALIGN)
    if header is not None:
        page[:] = header
    return memoryview(page)


def _write_object(
    path: Path, key: OffloadKey, payload: memoryview, fingerprint: bytes, fsync: bool, direct: bool
) -> None:
    payload = payload.cast("B")
    direct = direct and _is_aligned(payload)
    header = encode_header(key, payload, fingerprint, _ALIGN)
    tmp = f"{path}.{os.urandom(4).hex()}{_TMP_SUFFIX}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | (os.O_DIRECT if direct else 0)
    fd = os.open(tmp, flags, 0o600)
    try:
        _write_all(fd, [_header_buffer(header, direct), payload])
        if fsync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.rename(tmp, path)


def _write_all(fd: int, buffers: list[memoryview]) -> None:
    while buffers:
        written = os.writev(fd, buffers)
        while buffers and written >= buffers[0].nbytes:
            written -= buffers.pop(0).nbytes
        if buffers and written:
            buffers[0] = buffers[0][written:]


def _read_object(path: Path, key: OffloadKey, into: memoryview, fingerprint: bytes, direct: bool) -> ObjectHeader:
    into = into.cast("B")
    direct = direct and _is_aligned(into)
    header_buf = _header_buffer(None, direct)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if direct else 0))
    except FileNotFoundError:
        raise ObjectNotFoundError(key) from None
    try:
        file_size = os.fstat(fd).st_size
        received = _read_all(fd, [header_buf, into])
    finally:
        os.close(fd)
    if received < len(header_buf):
        raise CorruptObjectError(f"{path}: {received} bytes, shorter than its header")
    header = parse_header(header_buf, fingerprint, key)
    check_length(header, file_size - header.size, into.nbytes)
    return header


def _read_all(fd: int, buffers: list[memoryview]) -> int:
    total = offset = 0
    while buffers:
        got = os.preadv(fd, buffers, offset)
        if got == 0:
            break
        total += got
        offset += got
        while buffers and got >= buffers[0].nbytes:
            got -= buffers.pop(0).nbytes
        if buffers and got:
            buffers[0] = buffers[0][got:]
    return total


def _unlink_all(paths: list[Path]) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _scan(directory: Path, fingerprint: bytes) -> list[tuple[OffloadKey, int]]:
    """Objects under `directory`, oldest first; removes temporaries and objects whose
    header is not ours."""
    found: list[tuple[float, OffloadKey, int]] = []
    removed = 0
    for shard in _SHARDS:
        with os.scandir(directory / shard) as entries:
            for entry in entries:
                if not entry.is_file(follow_symlinks=False):
                    continue
                recovered = None if entry.name.endswith(_TMP_SUFFIX) else _check_header(entry, fingerprint)
                if recovered is None:
                    os.unlink(entry.path)
                    removed += 1
                else:
                    found.append(recovered)
    if removed:
        logger.warning("file tier %s: removed %d temporary or foreign files", directory, removed)
    found.sort(key=lambda item: item[0])
    return [(key, size) for _, key, size in found]


def _check_header(entry: os.DirEntry, fingerprint: bytes) -> tuple[float, OffloadKey, int] | None:
    try:
        key = OffloadKey(bytes.fromhex(entry.name))
        stat = entry.stat(follow_symlinks=False)
        with open(entry.path, "rb") as file:
            header = parse_header(file.read(header_size(len(key), _ALIGN)), fingerprint, key)
    except (ValueError, OSError):  # a name that is not hex, a bad header (CorruptObjectError)
        return None
    if stat.st_size != header.size + header.payload_len:
        return None
    return stat.st_mtime, key, stat.st_size


class FileTier(BlockStoreTier):
    """Tier type ``file``: a `FileBlockStore` behind the async-tier adapter."""

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str = "file",
        *,
        root_dir: str | os.PathLike,
        capacity_bytes: int | None = None,
        max_concurrency: int = 16,
        io_threads: int | None = None,
        fsync: bool = False,
        direct_io: bool = True,
        op_timeout_s: float = 30.0,
        batch_bytes: int = 4 << 20,
    ):
        """
        Args:
            root_dir: the directory holding the tier's files (required).
            capacity_bytes: bytes of files held at most (None: no limit).
            max_concurrency: block operations in flight at once.
            io_threads: threads of the tier's pool (default: `max_concurrency`).
            fsync: `fsync` every file before it becomes visible.
            direct_io: bypass the page cache with O_DIRECT where the filesystem allows.
            op_timeout_s: seconds one operation (a block, or a batch) may take before it fails.
            batch_bytes: a job's blocks go to the pool in batches of about this many bytes,
                one hop per batch.

        Raises:
            ValueError: an option is out of range.
            OSError: `root_dir` cannot be created or written.
        """
        threads = io_threads or max_concurrency
        super().__init__(
            offloading_spec,
            primary_kv_view,
            tier_type,
            store_factory=lambda fingerprint: FileBlockStore(root_dir, fingerprint, threads, fsync, direct_io),
            capacity_bytes=capacity_bytes,
            max_concurrency=max_concurrency,
            op_timeout_s=op_timeout_s,
            batch_bytes=batch_bytes,
        )
