"""The file tier's directories: a namespace of 256 shard directories and a quarantine (made
for the one-file-per-block layout only: `Namespace.make_shards`), kept open from
`open_namespace` to `Namespace.close`, made private (mode 0700) where created, and
the file name of each block's object.

Worker threads of the tier's pool (and the thread that opens the tier). See
`tiering.backends.file` for the layout and the safety rules; `tiering.backends.file.objects` does
the objects' reads and writes inside these directories.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import shutil
import stat
import threading
from pathlib import Path

from tiering.contract.keys import OffloadKey
from tiering.tiers.blockstore.generations import MANIFEST_KEY
from tiering.tiers.blockstore.store import NamespaceUsage, namespace_named

logger = logging.getLogger(__name__)

TMP_SUFFIX = ".tmp"
"""The suffix of an object's file while it is written (renamed into place when complete)."""
SHARDS = [f"{i:02x}" for i in range(256)]
QUARANTINE = "quarantine"
SEGMENTS = "segments"  # the segment layout's directory (`tiering.backends.file.segments`)
MAX_HEX_NAME = 200  # longer hex names (keys over 100 bytes) become hashes: names stay under 255
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # never a link; a FIFO never blocks the open


def object_name(key: OffloadKey) -> str:
    """The file name of `key`'s object: its hex, or ``h`` and a 256-bit hash of it for keys
    whose hex would not fit a file name."""
    hexed = key.hex()
    return hexed if len(hexed) <= MAX_HEX_NAME else "h" + hashlib.blake2b(key, digest_size=32).hexdigest()


def shard(key: OffloadKey) -> str:
    """The name of the shard directory of `key`'s object."""
    return SHARDS[shard_index(key)]


def shard_index(key: OffloadKey) -> int:
    """The index (0..255) of the shard directory of `key`'s object."""
    return hashlib.blake2b(key, digest_size=1).digest()[0]


# -- directories ----------------------------------------------------------------------------


class Namespace:
    """A namespace directory, open with its 256 shard directories and its quarantine (258
    descriptors, once `make_shards` has run; -1 for each not there before) from
    `open_namespace` to `close`: an operation on a block opens nothing but the block's file.
    A directory replaced while open is not followed: the tier keeps using the one it opened
    (another of this user's processes would have to do it). A shard
    directory removed while open (or the whole namespace) is made again by the first store
    into it (`reopen_shard`); the blocks it held are gone, each a miss when loaded."""

    def __init__(self, fd: int, shards: list[int], quarantine: int, path: Path | None = None):
        self.fd = fd
        self.shards = shards
        self.quarantine = quarantine
        self.path = path  # the namespace directory, to make again if it is removed
        self.created: list[Path] = []  # made by `open_namespace`, outermost first; [] if it existed
        self._lock = threading.Lock()
        self._retired: list[int] = []  # descriptors replaced by `reopen_shard`: other threads may use them

    def shard_fd(self, key: OffloadKey) -> int:
        """The open descriptor of `key`'s shard directory (valid until `close`)."""
        return self.shards[shard_index(key)]

    def make_shards(self) -> None:
        """Make and open the shard and quarantine directories not there at `open_namespace`
        (the one-file-per-block layout's; the segment layout needs none). A pool thread.

        Raises:
            OSError: a directory cannot be made or opened.
        """
        assert self.path is not None
        for index, shard in enumerate(SHARDS):
            if self.shards[index] < 0:
                self.shards[index] = private_subdir(self.fd, shard, self.path / shard)
        if self.quarantine < 0:
            self.quarantine = private_subdir(self.fd, QUARANTINE, self.path / QUARANTINE)

    def reopen_shard(self, key: OffloadKey, stale_fd: int) -> int:
        """The descriptor of `key`'s shard directory, made and opened again after a store
        found the one it used (`stale_fd`) removed: the namespace directory too, if it went
        with it. Any thread; one at a time.

        Raises:
            OSError: the directories cannot be made again (the message names them).
        """
        index = shard_index(key)
        with self._lock:
            if self.shards[index] != stale_fd:
                return self.shards[index]  # another thread made it again
            assert self.path is not None
            if os.fstat(self.fd).st_nlink == 0:  # the namespace itself was removed
                fd = _private_subdir_at(self.path.parent, self.path.name)
                self._retired.append(self.fd)
                self.fd = fd
            fd = private_subdir(self.fd, SHARDS[index], self.path / SHARDS[index])
            self._retired.append(stale_fd)
            self.shards[index] = fd
        logger.warning(
            "file tier: %s was removed while in use; made it again (the blocks it held are gone: each is a miss)",
            self.path / SHARDS[index],
        )
        return fd

    def close(self) -> None:
        """Close every descriptor; idempotent."""
        fds = [*self.shards, self.quarantine, self.fd, *self._retired]
        self.shards, self.quarantine, self.fd, self._retired = [], -1, -1, []
        for fd in fds:
            if fd >= 0:
                os.close(fd)


def open_namespace(root: Path, name: str) -> Namespace:
    """Make `root` (missing parents too, 0700), check it is private, and open its private
    subdirectory `name` (made if missing) with the shard and quarantine directories it holds
    (`Namespace.make_shards` makes the others). The caller closes the result (`Namespace.close`).

    Raises:
        PermissionError: `root` or a directory under it belongs to another user or is
            writable by group or others, or `root` cannot be written.
        OSError: a directory cannot be created or opened.
    """
    created = _make_private_parents(root)
    existed = os.path.lexists(root / name)
    namespace = Namespace(_private_subdir_at(root, name), [-1] * len(SHARDS), -1, root / name)
    namespace.created = created if existed else [*created, root / name]
    try:
        present = set(os.listdir(namespace.fd))
        for index, shard in enumerate(SHARDS):
            if shard in present:
                namespace.shards[index] = private_subdir(namespace.fd, shard, root / name / shard)
        if QUARANTINE in present:
            namespace.quarantine = private_subdir(namespace.fd, QUARANTINE, root / name / QUARANTINE)
    except BaseException:
        namespace.close()
        raise
    return namespace


def holds_objects(ns: Namespace) -> bool:
    """Whether any shard directory of `ns` holds an entry (one file per block's objects, or
    their temporaries): a read of each shard directory there, at most (a pool thread).

    Raises:
        OSError: a shard directory cannot be read.
    """
    for dir_fd in (fd for fd in ns.shards if fd >= 0):
        with os.scandir(dir_fd) as entries:
            if next(entries, None) is not None:
                return True
    return False


def _make_private_parents(root: Path) -> list[Path]:
    """Create `root` and its missing parents (0700); returns those it created, outermost first."""
    missing = []
    path = root.absolute()
    while not os.path.lexists(path):
        missing.append(path)
        path = path.parent
    created = []
    for path in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
            os.chmod(path, 0o700)  # whatever the umask
            created.append(path)
    return created


def remove_created(namespace: Namespace, segments: bool = False) -> None:
    """Remove the directories `open_namespace` created, innermost first, if the namespace
    holds nothing: its shard and quarantine directories, the namespace, then the parents it
    made; a parent that is not empty stops the removal there. A namespace where anything was
    stored since (by another engine of the same layout sharing it) stays whole; one that
    engine opened but has not stored into yet is removed (a window of its start-up, which
    it survives as a removed shard: `tiering.backends.file`). With `segments`, the segments
    directory is removed while empty, even where the namespace existed (this start made it).
    Closes `namespace` first."""
    path = namespace.path
    namespace.close()
    if segments and path is not None:  # made by this start, in a namespace that may have existed
        with contextlib.suppress(OSError):
            os.rmdir(path / SEGMENTS)
    if not namespace.created:
        return
    inner = namespace.created[-1]
    try:
        subdirs = [inner / name for name in (*SHARDS, QUARANTINE, SEGMENTS) if os.path.lexists(inner / name)]
        if any(os.listdir(path) for path in subdirs):
            return
        for path in [*subdirs, *reversed(namespace.created)]:
            os.rmdir(path)
    except OSError as exc:
        logger.debug("file tier: left %s in place: %s", exc.filename, exc.strerror)


def _private_subdir_at(root: Path, name: str) -> int:
    """`_private_subdir` `name` of the operator's `root` (a path that may hold links), once
    `root` is checked (`check_root`)."""
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        check_root(os.fstat(root_fd), root)
        return private_subdir(root_fd, name, root / name)
    finally:
        os.close(root_fd)


def private_subdir(parent_fd: int, name: str, path: Path) -> int:
    """Open (creating it 0700) the directory `name` under `parent_fd`, never through a link:
    a link there is replaced by a directory, its target left alone."""
    while True:
        try:
            os.mkdir(name, 0o700, dir_fd=parent_fd)
            created = True
        except FileExistsError:
            created = False
        try:
            fd = os.open(name, DIR_FLAGS, dir_fd=parent_fd)
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


def check_root(info: os.stat_result, path: Path) -> None:
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
        # a sticky directory (/tmp) is shared by design: never advise changing its mode
        chmod = "" if info.st_mode & stat.S_ISVTX else ", or chmod 700 it if it is the engine's alone"
        raise PermissionError(
            errno.EACCES,
            f"{path} is writable by group or others (mode {stat.S_IMODE(info.st_mode):04o}): another user could "
            f"plant blocks the engine would load as cache hits; use a directory of its own below it (the tier "
            f"creates it 0700){chmod}",
        )


def supports_direct_io(ns: Namespace) -> bool:
    probe = f".direct-probe-{os.urandom(4).hex()}{TMP_SUFFIX}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT | OPEN_FLAGS, 0o600, dir_fd=ns.fd)
    except OSError:
        return False
    os.close(fd)
    os.unlink(probe, dir_fd=ns.fd)
    return True


def namespace_usage(root: Path) -> list[NamespaceUsage]:
    """Every namespace directory under `root` (none if `root` is missing): its files, their
    bytes, and the newest file's modification time (a namespace without files: its
    directory's, which an engine's opening touches), temporaries (``*TMP_SUFFIX``: a write in
    progress, or one a killed process left) left out; and whether it holds an identity's
    manifest. One walk of each tree; links are never followed; nothing is written."""
    try:
        entries = sorted(os.scandir(root), key=lambda entry: entry.name)
    except FileNotFoundError:
        return []
    found = []
    for entry in entries:
        namespace = namespace_named(entry.name)
        if namespace is None or not entry.is_dir(follow_symlinks=False):
            continue
        files = size = 0
        newest: float | None = None
        for directory, _, names in os.walk(entry.path):
            for name in names:
                if name.endswith(TMP_SUFFIX):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    info = os.lstat(os.path.join(directory, name))
                    files, size = files + 1, size + info.st_size
                    newest = info.st_mtime if newest is None else max(newest, info.st_mtime)
        with contextlib.suppress(FileNotFoundError):
            newest = newest if newest is not None else os.lstat(entry.path).st_mtime
        manifest = os.path.join(entry.path, shard(MANIFEST_KEY), object_name(MANIFEST_KEY))
        found.append(NamespaceUsage(namespace, files, size, newest, os.path.lexists(manifest)))
    return found


def remove_unheld(ns_fd: int, path: Path) -> bool:
    """Remove the segments directory `path` under the namespace `ns_fd` if it exists and no
    engine holds its lock (segments an engine left when a later start chose one file per
    block: never recovered, counted or removed otherwise). Returns whether it was removed.

    Raises:
        OSError: it could not be opened or removed (what was removed stays so).
    """
    try:
        dir_fd = os.open(path.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=ns_fd)
    except FileNotFoundError:
        return False
    try:
        try:
            fcntl.flock(dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # an engine uses them
        shutil.rmtree(path)  # under the lock: no engine opens them meanwhile
        return True
    finally:
        os.close(dir_fd)


def remove_unless_held(path: Path, held_here: bool) -> None:
    """Remove the namespace directory `path` with everything in it (links removed, never
    followed), under the lock of its segments directory where it has one: refused while
    another store holds that lock (an engine uses the segments, however idle). `held_here`:
    the caller's own store holds it (its own namespace, removed by itself).

    Raises:
        OSError: EBUSY where another store holds the segments; a file or directory could not
            be removed (what was removed stays so).
    """
    if held_here:
        shutil.rmtree(path)
        return
    try:
        dir_fd = os.open(path / SEGMENTS, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        shutil.rmtree(path)
        return
    try:
        try:
            fcntl.flock(dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OSError(errno.EBUSY, "its segments are held by a running engine", str(path)) from None
        shutil.rmtree(path)  # under the lock: no engine opens them meanwhile
    finally:
        os.close(dir_fd)
