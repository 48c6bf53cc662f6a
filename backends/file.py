"""The ``file`` tier: one file per block under a directory, written atomically.

Layout: ``<root_dir>/<layout fingerprint hex>/<shard>/<name>``, where the shard is the first
byte (hex) of a hash of the key, 256 shards, and the name is the key in hex (a hash of it,
``h<64 hex>``, for keys too long for a file name; the header holds the key either way). No
key can name a path outside its shard. Objects a load cannot use for a reason of their own
(a directory or FIFO in their place, EACCES, EIO) are deleted, or moved to
``<namespace>/quarantine/`` when they cannot be deleted.

Nothing outside ``root_dir`` is ever touched: every operation is relative to an open
directory and refuses symbolic links (``O_NOFOLLOW``, ``dir_fd``); a link found where a
shard directory belongs is replaced, its target left alone. ``root_dir`` must belong to the
engine's user and not be writable by group or others (another user could plant blocks the
engine would load as hits); directories the tier creates, parents included, are 0700
whatever the umask, files 0600.

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
operation is never abandoned: the await is shielded from cancellation, so the coroutine
does not return while its thread may still touch the row (the adapter times the call out
around it and keeps the row out of use until then).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import mmap
import os
import stat
import threading
from collections.abc import Callable, Collection, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated, Any, TypeVar

import aiofiles.os
import anyio
import numpy as np
from pydantic import AfterValidator

from tiering.blockstore import BlockStore, BlockStoreTier
from tiering.errors import CorruptObjectError, ObjectNotFoundError, UnusableObjectError
from tiering.factory import Count, Seconds
from tiering.keys import OffloadKey
from tiering.object_format import MAX_KEY_BYTES, ObjectHeader, check_length, encode_header, header_size, parse_header

logger = logging.getLogger(f"tiering.{__name__}")  # one logger tree: "tiering"

T = TypeVar("T")
_TMP_SUFFIX = ".tmp"
_SHARDS = [f"{i:02x}" for i in range(256)]
_QUARANTINE = "quarantine"
_ALIGN = 4096  # O_DIRECT alignment of buffers, lengths and offsets
_MAX_HEX_NAME = 200  # longer hex names (keys over 100 bytes) become hashes: names stay under 255
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # never a link; a FIFO never blocks the open
# Errors that say one object is unusable, not that the backend is sick.
_OBJECT_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EISDIR, errno.ELOOP, errno.ENXIO, errno.EIO})
_thread_local = threading.local()


def object_name(key: OffloadKey) -> str:
    """The file name of `key`'s object: its hex, or ``h`` and a 256-bit hash of it for keys
    whose hex would not fit a file name."""
    hexed = key.hex()
    return hexed if len(hexed) <= _MAX_HEX_NAME else "h" + hashlib.blake2b(key, digest_size=32).hexdigest()


def check_root_dir(value: str) -> str:
    """`root_dir` as a config value, checked at load: not empty; an existing directory that
    is private to the engine's user and writable, or creatable under a writable directory.

    Raises:
        ValueError: what is wrong, naming the path.
    """
    if not value:
        raise ValueError("must not be empty")
    path = Path(value)
    try:
        info = os.stat(path)
    except FileNotFoundError:
        parent = path.absolute().parent
        while not os.path.lexists(parent):
            parent = parent.parent
        if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
            raise ValueError(f"{path} cannot be created: {parent} is not a writable directory") from None
        return value
    except OSError as exc:
        raise ValueError(f"{path} cannot be used: {exc.strerror}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise ValueError(f"{path} is not a directory")
    try:
        _check_root(info, path)
    except PermissionError as exc:
        raise ValueError(exc.strerror) from None
    return value


RootDir = Annotated[str, AfterValidator(check_root_dir)]


def _shard(key: OffloadKey) -> str:
    return hashlib.blake2b(key, digest_size=1).hexdigest()


class FileBlockStore(BlockStore):
    """Objects as files under ``root_dir/<fingerprint>``.

    Args:
        root_dir: the tier's directory (created 0700 with its missing parents).
        fingerprint: the layout fingerprint; it names the namespace directory.
        io_threads: threads of the store's pool, that is block operations run at once.
        fsync: `fsync` each file before renaming it into place (durable across power loss).
        direct_io: use O_DIRECT where the filesystem supports it.

    Raises:
        ValueError: `root_dir` is empty or `io_threads` < 1.
    """

    header_align = _ALIGN

    def __init__(
        self,
        root_dir: RootDir,
        fingerprint: bytes,
        io_threads: Count = 16,
        fsync: bool = False,
        direct_io: bool = True,
    ):
        super().__init__(fingerprint)
        if io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {io_threads}")
        if not os.fspath(root_dir):
            raise ValueError("root_dir must not be empty")
        self.root_dir = Path(root_dir)
        self.directory = self.root_dir / fingerprint.hex()
        self.fsync = fsync
        self.direct_io = direct_io
        self._io_threads = io_threads
        self._pool: ThreadPoolExecutor | None = None
        self._fd = -1  # the namespace directory, open from `open` to `close`

    def path(self, key: OffloadKey) -> Path:
        """The file of `key` (for operators and tests: the store itself never uses paths)."""
        return self.directory / _shard(key) / object_name(key)

    async def _run(self, func: Callable[..., T], *args: Any) -> T:
        self.check_open()
        with anyio.CancelScope(shield=True):
            result = await aiofiles.os.wrap(func)(*args, executor=self._pool)
        return result

    async def open(self) -> None:
        """Create (or check) the directories and probe O_DIRECT.

        Raises:
            PermissionError: `root_dir` cannot be written, belongs to another user, or is
                writable by group or others (the message names it and says what to do).
            OSError: `root_dir` cannot be created or is not a directory.
        """
        self._pool = ThreadPoolExecutor(self._io_threads, thread_name_prefix="tiering-file")
        try:
            self._fd = await aiofiles.os.wrap(_open_namespace)(self.root_dir, self.directory.name, executor=self._pool)
            await super().open()
            if self.direct_io and not await self._run(_supports_direct_io, self._fd):
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
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    async def put(self, key: OffloadKey, payload: memoryview) -> None:
        await self._run(_write_object, self._fd, key, payload, self.fingerprint, self.fsync, self.direct_io)

    async def get(self, key: OffloadKey, into: memoryview) -> ObjectHeader:
        return await self._run(_read_object, self._fd, key, into, self.fingerprint, self.direct_io)

    async def put_many(self, items: Sequence[tuple[OffloadKey, memoryview]]) -> list[Exception | None]:
        """All puts in one hop, one after the other in one pool thread."""
        calls = [(self._fd, key, data, self.fingerprint, self.fsync, self.direct_io) for key, data in items]
        return await self._run(_each, _write_object, calls)

    async def get_many(self, items: Sequence[tuple[OffloadKey, memoryview]]) -> list[ObjectHeader | Exception]:
        """All gets in one hop, one after the other in one pool thread."""
        calls = [(self._fd, key, into, self.fingerprint, self.direct_io) for key, into in items]
        return await self._run(_each, _read_object, calls)

    async def exists(self, key: OffloadKey) -> bool:
        return await self._run(_exists, self._fd, key)

    async def delete_many(self, keys: Collection[OffloadKey]) -> None:
        await self._run(_delete_all, self._fd, list(keys))

    async def recover(self) -> list[tuple[OffloadKey, int]]:
        return await self._run(_scan, self._fd, self.directory, self.fingerprint)


def _each(func: Callable[..., Any], calls: list[tuple]) -> list[Any]:
    """func(*args) for each call: its result, or the exception it raised."""
    outcomes: list[Any] = []
    for args in calls:
        try:
            outcomes.append(func(*args))
        except Exception as exc:
            outcomes.append(exc)
    return outcomes


# -- directories ----------------------------------------------------------------------------


def _open_namespace(root: Path, name: str) -> int:
    """Make `root` (missing parents too, 0700), check it is private, and open its private
    subdirectory `name` with the shard and quarantine directories. Returns its fd."""
    _make_private_parents(root)
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the operator's path: links allowed
    try:
        _check_root(os.fstat(root_fd), root)
        ns_fd = _private_subdir(root_fd, name, root / name)
    finally:
        os.close(root_fd)
    try:
        for shard in [*_SHARDS, _QUARANTINE]:
            os.close(_private_subdir(ns_fd, shard, root / name / shard))
    except BaseException:
        os.close(ns_fd)
        raise
    return ns_fd


def _make_private_parents(root: Path) -> None:
    missing = []
    path = root.absolute()
    while not os.path.lexists(path):
        missing.append(path)
        path = path.parent
    for path in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
            os.chmod(path, 0o700)  # whatever the umask


def _private_subdir(parent_fd: int, name: str, path: Path) -> int:
    """Open (creating it 0700) the directory `name` under `parent_fd`, never through a link:
    a link there is replaced by a directory, its target left alone."""
    while True:
        try:
            os.mkdir(name, 0o700, dir_fd=parent_fd)
            created = True
        except FileExistsError:
            created = False
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
        except OSError as exc:
            mode = os.stat(name, dir_fd=parent_fd, follow_symlinks=False).st_mode
            if exc.errno in (errno.ELOOP, errno.ENOTDIR) and stat.S_ISLNK(mode):
                logger.warning("file tier: %s was a symbolic link; replaced by a directory (target untouched)", path)
                os.unlink(name, dir_fd=parent_fd)
                continue
            raise
        try:
            if created:
                os.fchmod(fd, 0o700)
            _check_private(os.fstat(fd), path)
        except BaseException:
            os.close(fd)
            raise
        return fd


def _check_root(info: os.stat_result, path: Path) -> None:
    _check_private(info, path)
    if not os.access(path, os.W_OK | os.X_OK):
        raise PermissionError(errno.EACCES, f"{path} is not writable")


def _check_private(info: os.stat_result, path: Path) -> None:
    if info.st_uid != os.geteuid():
        raise PermissionError(
            errno.EACCES,
            f"{path} belongs to uid {info.st_uid}, not to this engine's user (uid {os.geteuid()}): another user "
            "could plant blocks the engine would load as cache hits; use a directory the engine's user owns",
        )
    if info.st_mode & 0o022:
        raise PermissionError(
            errno.EACCES,
            f"{path} is writable by group or others (mode {stat.S_IMODE(info.st_mode):04o}): another user could "
            "plant blocks the engine would load as cache hits; chmod 700 it",
        )


@contextlib.contextmanager
def _directory(parent_fd: int, name: str) -> Iterator[int]:
    """The directory `name` under `parent_fd`, opened without following a link."""
    fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    try:
        yield fd
    finally:
        os.close(fd)


def _supports_direct_io(ns_fd: int) -> bool:
    probe = f".direct-probe-{os.urandom(4).hex()}{_TMP_SUFFIX}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT | _OPEN_FLAGS, 0o600, dir_fd=ns_fd)
    except OSError:
        return False
    os.close(fd)
    os.unlink(probe, dir_fd=ns_fd)
    return True


# -- objects --------------------------------------------------------------------------------


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


def _write_object(ns_fd: int, key: OffloadKey, payload: memoryview, fingerprint: bytes, fsync: bool, direct: bool):
    payload = payload.cast("B")
    direct = direct and _is_aligned(payload)
    header = encode_header(key, payload, fingerprint, _ALIGN)
    tmp = f"{os.urandom(8).hex()}{_TMP_SUFFIX}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _OPEN_FLAGS | (os.O_DIRECT if direct else 0)
    with _directory(ns_fd, _shard(key)) as dir_fd:
        fd = os.open(tmp, flags, 0o600, dir_fd=dir_fd)
        try:
            _write_all(fd, [_header_buffer(header, direct), payload])
            if fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(tmp, dir_fd=dir_fd)
            raise
        os.close(fd)
        name = object_name(key)
        try:
            os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except IsADirectoryError:  # a directory squats the name: set it aside, then retry
            _quarantine(ns_fd, dir_fd, name)
            os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            os.unlink(tmp, dir_fd=dir_fd)
            raise


def _write_all(fd: int, buffers: list[memoryview]) -> None:
    while buffers:
        written = os.writev(fd, buffers)
        while buffers and written >= buffers[0].nbytes:
            written -= buffers.pop(0).nbytes
        if buffers and written:
            buffers[0] = buffers[0][written:]


def _read_object(ns_fd: int, key: OffloadKey, into: memoryview, fingerprint: bytes, direct: bool) -> ObjectHeader:
    into = into.cast("B")
    direct = direct and _is_aligned(into)
    header_buf = _header_buffer(None, direct)
    with _directory(ns_fd, _shard(key)) as dir_fd:
        name = object_name(key)
        try:
            fd = os.open(name, os.O_RDONLY | _OPEN_FLAGS | (os.O_DIRECT if direct else 0), dir_fd=dir_fd)
        except FileNotFoundError:
            raise ObjectNotFoundError(key) from None
        except OSError as exc:
            if not stat.S_ISREG(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
                raise UnusableObjectError(f"{name}: not a regular file") from exc
            raise _unusable(name, exc) from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnusableObjectError(f"{name}: not a regular file (mode {info.st_mode:o})")
        received = _read_all(fd, [header_buf, into])
    except OSError as exc:
        raise _unusable(name, exc) from exc
    finally:
        os.close(fd)
    if received < len(header_buf):
        raise CorruptObjectError(f"{name}: {received} bytes, shorter than its header")
    header = parse_header(header_buf, fingerprint, key)
    check_length(header, info.st_size - header.size, into.nbytes)
    return header


def _unusable(name: str, exc: OSError) -> Exception:
    """`exc` as an `UnusableObjectError` when it is about this object only, else as it is."""
    if exc.errno in _OBJECT_ERRNOS:
        return UnusableObjectError(f"{name}: {exc.strerror}")
    return exc


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


def _exists(ns_fd: int, key: OffloadKey) -> bool:
    with _directory(ns_fd, _shard(key)) as dir_fd:
        try:
            return stat.S_ISREG(os.stat(object_name(key), dir_fd=dir_fd, follow_symlinks=False).st_mode)
        except FileNotFoundError:
            return False


def _delete_all(ns_fd: int, keys: list[OffloadKey]) -> None:
    for key in keys:
        with _directory(ns_fd, _shard(key)) as dir_fd:
            name = object_name(key)
            try:
                os.unlink(name, dir_fd=dir_fd)
            except FileNotFoundError:
                pass
            except (IsADirectoryError, PermissionError):
                _quarantine(ns_fd, dir_fd, name)


def _quarantine(ns_fd: int, dir_fd: int, name: str) -> None:
    """Move what sits at `name` (a directory, say) out of the way, into the quarantine."""
    with _directory(ns_fd, _QUARANTINE) as quarantine_fd:
        os.rename(name, f"{name}.{os.urandom(4).hex()}", src_dir_fd=dir_fd, dst_dir_fd=quarantine_fd)
    logger.warning("file tier: moved an unusable %s to %s/ for inspection", name, _QUARANTINE)


def _scan(ns_fd: int, directory: Path, fingerprint: bytes) -> list[tuple[OffloadKey, int]]:
    """Objects in the namespace, oldest first; removes temporaries and regular files that
    are not whole objects of ours. Never follows a link."""
    found: list[tuple[float, OffloadKey, int]] = []
    removed = 0
    for shard in _SHARDS:
        with _directory(ns_fd, shard) as dir_fd, os.scandir(dir_fd) as entries:
            for entry in entries:
                if not entry.is_file(follow_symlinks=False):
                    continue  # a link, directory or FIFO: never loaded; a load or put sets it aside
                recovered = None if entry.name.endswith(_TMP_SUFFIX) else _check_header(dir_fd, entry.name, fingerprint)
                if recovered is None:
                    os.unlink(entry.name, dir_fd=dir_fd)
                    removed += 1
                else:
                    found.append(recovered)
    if removed:
        logger.warning("file tier %s: removed %d temporary or foreign files", directory, removed)
    found.sort(key=lambda item: item[0])
    return [(key, size) for _, key, size in found]


def _check_header(dir_fd: int, name: str, fingerprint: bytes) -> tuple[float, OffloadKey, int] | None:
    try:
        fd = os.open(name, os.O_RDONLY | _OPEN_FLAGS, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        header = parse_header(os.pread(fd, header_size(MAX_KEY_BYTES, _ALIGN), 0), fingerprint)
    except (CorruptObjectError, OSError):
        return None
    finally:
        os.close(fd)
    if not stat.S_ISREG(info.st_mode) or object_name(header.key) != name:
        return None
    if info.st_size != header.size + header.payload_len:
        return None
    return info.st_mtime, header.key, info.st_size


class FileTier(BlockStoreTier):
    """Tier type ``file``: a `FileBlockStore` behind the async-tier adapter."""

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str = "file",
        *,
        root_dir: RootDir,
        capacity_bytes: int | None = None,
        max_concurrency: Count = 16,
        io_threads: Count | None = None,
        fsync: bool = False,
        direct_io: bool = True,
        op_timeout_s: Seconds = 30.0,
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
        threads = max_concurrency if io_threads is None else io_threads
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
