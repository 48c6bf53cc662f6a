"""The file tier's blocking half for objects: every system call on the blocks' files (writes,
reads, existence, deletes, the scan that recovers them); the directories they live in are
`tiering.backends.file.dirs`'.

Worker threads of the tier's pool only (each function runs whole in one thread, one hop per
block or batch). See `tiering.backends.file` for the layout, the safety rules and the I/O
modes these functions implement.

A block costs three system calls to read (open, one vectored read, close) and four to write
(open, vectored write, close, rename; a fifth, fsync, when asked): the namespace keeps its shard
directories open (`Namespace`), and a read learns the file's length from the read itself.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import stat
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tiering.backends.buffers import advance
from tiering.backends.file.dirs import (
    OPEN_FLAGS,
    QUARANTINE,
    TMP_SUFFIX,
    Namespace,
    object_name,
)
from tiering.contract.keys import OffloadKey
from tiering.errors import CorruptObjectError, ForgedObjectError, ObjectNotFoundError, UnusableObjectError
from tiering.tiers.blockstore.store import RecoveryProgress
from tiering.tiers.object_format import (
    MAX_KEY_BYTES,
    ObjectHeader,
    check_length,
    encode_object,
    header_size,
    object_size,
    parse_header,
    verify_payload,
)
from tiering.tiers.seal import Seal

logger = logging.getLogger(__name__)

TEMPORARY_GRACE_S = 300.0
"""A temporary file younger than this may be a write in flight of another engine sharing the
namespace (a write is abandoned after ``op_timeout_s``, 30 s by default): recovery leaves it,
and removes it at a later start once it is older."""
ALIGN = 4096  # O_DIRECT alignment of buffers, lengths and offsets
# Errors that say one object is unusable, not that the backend is sick.
_OBJECT_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EISDIR, errno.ESPIPE, errno.ELOOP, errno.ENXIO, errno.EIO})
_NOT_A_FILE_ERRNOS = frozenset({errno.EISDIR, errno.ESPIPE})  # a read of a directory, of a FIFO
_thread_local = threading.local()


def each(func: Callable[..., Any], calls: list[tuple]) -> list[Any]:
    """func(*args) for each call: its result, or the exception it raised."""
    outcomes: list[Any] = []
    for args in calls:
        try:
            outcomes.append(func(*args))
        except Exception as exc:
            outcomes.append(exc)
    return outcomes


# -- objects --------------------------------------------------------------------------------


def is_aligned(buffer: memoryview) -> bool:
    """Whether O_DIRECT can move `buffer`: its address and length are multiples of `ALIGN`."""
    if buffer.nbytes % ALIGN:
        return False
    if buffer.readonly:  # ctypes maps writable buffers only
        return np.frombuffer(buffer, dtype=np.uint8).ctypes.data % ALIGN == 0
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer)) % ALIGN == 0


def _scratch() -> tuple[memoryview, memoryview]:
    """This thread's two page-aligned scratch pages: one for a header, one to catch bytes
    past an object's end (any I/O mode may use them)."""
    pages = getattr(_thread_local, "pages", None)
    if pages is None:
        view = memoryview(mmap.mmap(-1, 2 * ALIGN))
        pages = _thread_local.pages = (view[:ALIGN], view[ALIGN:])
    return pages


def write_object(
    ns: Namespace,
    key: OffloadKey,
    payload: memoryview,
    fingerprint: bytes,
    seal: Seal | None,
    fsync: bool,
    direct: bool,
) -> None:
    header, payload = encode_object(key, payload.cast("B"), fingerprint, ALIGN, seal)
    direct = direct and is_aligned(payload)
    tmp = f"{os.urandom(8).hex()}{TMP_SUFFIX}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | OPEN_FLAGS | (os.O_DIRECT if direct else 0)
    dir_fd = ns.shard_fd(key)
    header_page = _scratch()[0]
    header_page[: len(header)] = header
    try:
        fd = os.open(tmp, flags, 0o600, dir_fd=dir_fd)
    except FileNotFoundError:  # the shard directory was removed under us
        dir_fd = ns.reopen_shard(key, dir_fd)
        fd = os.open(tmp, flags, 0o600, dir_fd=dir_fd)
    try:
        _write_all(fd, [header_page[: len(header)], payload])
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
        _quarantine(ns, dir_fd, name)
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        os.unlink(tmp, dir_fd=dir_fd)
        raise


def _write_all(fd: int, buffers: list[memoryview]) -> None:
    while buffers:
        advance(buffers, os.writev(fd, buffers))


def read_object(
    ns: Namespace, key: OffloadKey, into: memoryview, fingerprint: bytes, seal: Seal | None, direct: bool
) -> ObjectHeader:
    """Read `key`'s object, its payload into `into`, and check its header, length and checksum
    or signature (`verify_payload`, in this thread, while the payload is in the CPU's
    cache). One vectored read fills the header page, the payload and a page past it, which
    must stay empty: no `fstat` is needed for the length.

    Raises:
        ObjectNotFoundError: no such object.
        UnusableObjectError: something else sits at its name (a directory, a FIFO: reads of
            those fail with EISDIR or ESPIPE), or reading it fails for a reason of its own.
        CorruptObjectError: a short or long file, a bad header, or a checksum mismatch.
        ForgedObjectError: its seal does not open with `seal` (see `parse_header`).
        OSError: the directory or the device fails.
    """
    into = into.cast("B")
    direct = direct and is_aligned(into)
    header_page, past_end = _scratch()
    dir_fd = ns.shard_fd(key)
    name = object_name(key)
    try:
        fd = os.open(name, os.O_RDONLY | OPEN_FLAGS | (os.O_DIRECT if direct else 0), dir_fd=dir_fd)
    except FileNotFoundError:
        raise ObjectNotFoundError(key) from None
    except OSError as exc:
        if not stat.S_ISREG(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
            raise UnusableObjectError(f"{name}: not a regular file") from exc
        raise _unusable(name, exc) from exc
    try:
        received = _read_all(fd, [header_page, into, past_end])
    except OSError as exc:
        raise _unusable(name, exc) from exc
    finally:
        os.close(fd)
    if received < ALIGN:
        raise CorruptObjectError(f"{name}: {received} bytes, shorter than its header")
    header = parse_header(header_page, fingerprint, key, seal)
    check_length(header, received - header.size, into.nbytes)
    verify_payload(header, into, seal)
    return header


def _unusable(name: str, exc: OSError) -> Exception:
    """`exc` as an `UnusableObjectError` when it is about this object only, else as it is."""
    if exc.errno in _NOT_A_FILE_ERRNOS:
        return UnusableObjectError(f"{name}: not a regular file ({exc.strerror})")
    if exc.errno in _OBJECT_ERRNOS:
        return UnusableObjectError(f"{name}: {exc.strerror}")
    return exc


def _read_all(fd: int, buffers: list[memoryview]) -> int:
    """Fill `buffers` from the start of `fd`; the bytes read. Stops at the end of the file,
    or as soon as all but the last buffer are full: the last only catches bytes past the
    expected end, and a regular file that filled the others in one call ends there (a second
    call would read 0 bytes)."""
    expected = sum(buffer.nbytes for buffer in buffers[:-1])
    total = 0
    while buffers:
        got = os.preadv(fd, buffers, total)
        total += got
        if got == 0 or total == expected:
            break
        advance(buffers, got)
    return total


def exists(ns: Namespace, key: OffloadKey) -> bool:
    try:
        return stat.S_ISREG(os.stat(object_name(key), dir_fd=ns.shard_fd(key), follow_symlinks=False).st_mode)
    except FileNotFoundError:
        return False


def delete_all(ns: Namespace, keys: list[OffloadKey]) -> None:
    for key in keys:
        dir_fd, name = ns.shard_fd(key), object_name(key)
        try:
            os.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        except (IsADirectoryError, PermissionError):
            _quarantine(ns, dir_fd, name)


def _quarantine(ns: Namespace, dir_fd: int, name: str) -> None:
    """Move what sits at `name` (a directory, say) out of the way, into the quarantine."""
    os.rename(name, f"{name}.{os.urandom(4).hex()}", src_dir_fd=dir_fd, dst_dir_fd=ns.quarantine)
    logger.warning("file tier: moved an unusable %s to %s/ for inspection", name, QUARANTINE)


def scan(
    ns: Namespace,
    directory: Path,
    fingerprint: bytes,
    seal: Seal | None,
    block_bytes: int | None = None,
    tidy: bool = True,
) -> list[tuple[OffloadKey, int]]:
    """Objects in the namespace, oldest first (by last write); with `tidy`, removes
    temporaries older than `TEMPORARY_GRACE_S`, regular files that are not whole objects of
    ours, and objects whose seal `seal` does not open (sealed by a key dropped from
    `integrity`, or planted: a namespace is one deployment's, and nothing else would ever
    give their space back); without, leaves them out and writes nothing.
    Without a seal, given the rows' `block_bytes`, an object named by its key's hex is known
    by its name and size (one `stat`, no open): its header is checked when it is loaded, as
    every load's is. Never follows a link."""
    found: list[tuple[float, OffloadKey, int]] = []
    removed = unopened = 0
    now = time.time()
    progress = RecoveryProgress(f"file tier {directory}")
    sizes: dict[int, int] = {}  # object bytes by key length
    for dir_fd in ns.shards:
        progress.add(len(found) - progress.count)
        with os.scandir(dir_fd) as entries:
            for entry in entries:
                if not entry.is_file(follow_symlinks=False):
                    continue  # a link, directory or FIFO: never loaded; a load or put sets it aside
                try:
                    temporary = entry.name.endswith(TMP_SUFFIX)
                    if temporary and _written_since(entry, now - TEMPORARY_GRACE_S):
                        continue  # perhaps another engine's write in flight (or renamed by now)
                    if temporary:
                        recovered = None
                    elif seal is None and block_bytes is not None and (key := _named_key(entry.name)) is not None:
                        size = sizes.get(len(key))
                        if size is None:
                            size = sizes[len(key)] = object_size(len(key), block_bytes, ALIGN)
                        recovered = _sized(entry, key, size)
                    else:
                        recovered = _check_header(dir_fd, entry.name, fingerprint, seal)
                except ForgedObjectError:
                    with contextlib.suppress(FileNotFoundError):  # removed meanwhile
                        if tidy:
                            os.unlink(entry.name, dir_fd=dir_fd)
                            unopened += 1
                    continue
                if recovered is None and tidy:
                    with contextlib.suppress(FileNotFoundError):  # another engine's, removed meanwhile
                        os.unlink(entry.name, dir_fd=dir_fd)
                        removed += 1
                elif recovered is not None:
                    found.append(recovered)
    if removed:
        logger.warning("file tier %s: removed %d temporary or foreign files", directory, removed)
    if unopened:
        logger.warning(
            "file tier %s: reclaimed %d objects whose seal does not open (a key dropped from integrity, or planted)",
            directory,
            unopened,
        )
    found.sort(key=lambda item: item[0])
    return [(key, size) for _, key, size in found]


def _named_key(name: str) -> OffloadKey | None:
    """The key a file named by its hex holds, or None (a hashed name, or not a key's)."""
    try:
        return OffloadKey(bytes.fromhex(name))
    except ValueError:
        return None


def _sized(entry: os.DirEntry[str], key: OffloadKey, size: int) -> tuple[float, OffloadKey, int] | None:
    """(mtime, key, bytes) of the file `entry` if it has an object's `size`, else None."""
    try:
        info = entry.stat(follow_symlinks=False)
    except OSError:
        return None
    return (info.st_mtime, key, size) if info.st_size == size and stat.S_ISREG(info.st_mode) else None


def _written_since(entry: os.DirEntry[str], since: float) -> bool:
    """Whether the file `entry` was modified after `since` (seconds since the epoch), or is
    gone already."""
    try:
        return entry.stat(follow_symlinks=False).st_mtime > since
    except FileNotFoundError:
        return True


def _check_header(
    dir_fd: int, name: str, fingerprint: bytes, seal: Seal | None
) -> tuple[float, OffloadKey, int] | None:
    """(mtime, key, bytes) of the object file `name`, or None if it is not a whole object.

    Raises:
        ForgedObjectError: a whole object whose seal `seal` does not open.
    """
    try:
        fd = os.open(name, os.O_RDONLY | OPEN_FLAGS, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        header = parse_header(os.pread(fd, header_size(MAX_KEY_BYTES, ALIGN), 0), fingerprint, seal=seal)
    except ForgedObjectError:
        raise
    except (CorruptObjectError, OSError):
        return None
    finally:
        os.close(fd)
    if not stat.S_ISREG(info.st_mode) or object_name(header.key) != name:
        return None
    if info.st_size != header.size + header.payload_len:
        return None
    return info.st_mtime, header.key, info.st_size


class OneFilePerBlock:
    """The ``files`` `tiering.backends.file.store.Layout`: one file per block in the
    namespace's shard directories; each call runs whole in one pool thread.

    Args:
        ns: the open namespace; directory: its path (for log lines).
        fingerprint, seal: the tier's layout fingerprint and seal, as objects carry them.
        fsync: `fsync` each file before it is renamed into place.
        direct: O_DIRECT for buffers that are page-aligned in memory and length.
        block_bytes: the rows' size: lets `scan` know a plain object by its name and size.
    """

    name = "files"
    max_read_threads: int | None = None  # as many as the tier has
    exists_needs_io = True

    def __init__(
        self,
        ns: Namespace,
        directory: Path,
        fingerprint: bytes,
        seal: Seal | None,
        fsync: bool,
        direct: bool,
        block_bytes: int | None,
    ):
        self._ns, self._directory = ns, directory
        self._fingerprint, self._seal, self._fsync, self._direct = fingerprint, seal, fsync, direct
        self._block_bytes = block_bytes
        self.tidy = True  # `recover` removes what is not a whole object of ours (`scan`)

    def put_many(self, items: Sequence[tuple[OffloadKey, memoryview]]) -> list[Exception | None]:
        """One block after the other: None for each written, or the exception it raised."""
        fingerprint, seal, fsync, direct = self._fingerprint, self._seal, self._fsync, self._direct
        return each(write_object, [(self._ns, key, data, fingerprint, seal, fsync, direct) for key, data in items])

    def get_many(self, items: Sequence[tuple[OffloadKey, memoryview]]) -> list[ObjectHeader | Exception]:
        """One block after the other (`read_object`): its header, or the exception it raised."""
        fingerprint, seal, direct = self._fingerprint, self._seal, self._direct
        return each(read_object, [(self._ns, key, into, fingerprint, seal, direct) for key, into in items])

    def exists(self, key: OffloadKey) -> bool:
        return exists(self._ns, key)

    def delete_many(self, keys: Sequence[OffloadKey]) -> None:
        delete_all(self._ns, list(keys))

    def recover(self) -> list[tuple[OffloadKey, int]]:
        return scan(self._ns, self._directory, self._fingerprint, self._seal, self._block_bytes, self.tidy)

    def close(self) -> None:
        """Nothing to close: the namespace is the store's."""
