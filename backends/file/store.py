"""The ``file`` tier: blocks under a directory, one file per block written atomically (what
follows describes that layout) or, for small blocks, many per segment file (``layout``, see
`tiering.backends.file.options.FileOptions` and `tiering.backends.file.segments`).

Loop thread: `FileBlockStore`'s coroutines; its pool's threads run `objects`. Its config
keys: `tiering.backends.file.options`.

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

Each operation (or batch) is one function of `tiering.backends.file.objects` run in one hop on the
tier's own thread pool (``run_in_executor``): open, vectored write or read, close, rename,
all in the worker thread, so a block costs one executor hop instead of one per system call
(aiofiles, one hop per call on a shared executor, would cost four or more per block and
offers neither ``dir_fd`` nor vectored reads into a primary row). Writes go to a
temporary name and are renamed into place (optionally after `fsync`), so a crash leaves a
whole object or a temporary file that the next start removes. A thread already running an
operation is never abandoned: the await is shielded from cancellation, so the coroutine
does not return while its thread may still touch the row (the adapter times the call out
around it and keeps the row out of use until then).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import tempfile
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Executor
from functools import partial
from pathlib import Path
from typing import Any, ClassVar, Protocol, TypeVar

import anyio
from pydantic import BaseModel

from tiering.backends.file import dirs, objects, segments
from tiering.backends.file.options import FileOptions
from tiering.backends.file.pool import DaemonThreadPool
from tiering.contract.keys import OffloadKey
from tiering.contract.mediums import LOCAL, REMOTE
from tiering.tiers.blockstore import BlockStore, BlockStoreSettings
from tiering.tiers.blockstore.store import NamespaceUsage
from tiering.tiers.object_format import ObjectHeader

logger = logging.getLogger(__name__)

T = TypeVar("T")


SEGMENT_BLOCKS_UNDER = 1 << 20
"""``layout: auto`` keeps blocks smaller than this in segments: per block, the one-file layout
costs three system calls to read and four to write, which at 64 KiB cost more than the
bytes."""
CALLS_PER_CPU = 2
"""A buffered call of the one-file layout keeps a CPU busy (a copy and a checksum per block, the
page cache at the other end): the store runs at most this many such calls per CPU the process
may use at once (`BlockStore.calls_at_once`). More only take turns on the same CPUs, each a
hop and a thread handing the GIL around. Segments keep the tier's calls: their small blocks
cost Python and system calls, which more calls overlap. The measurements: docs/results.md,
"The measurements behind the constants"."""


class Layout(Protocol):
    """How a namespace holds its blocks, behind one interface: `objects.OneFilePerBlock`
    (``files``) or `segments.SegmentLog` (``segments``). Every method is a blocking call that
    runs whole in one pool thread (`exists` may run on the loop where `exists_needs_io` is
    False)."""

    name: str
    max_read_threads: int | None  # reads run on at most this many threads (None: the tier's)
    exists_needs_io: bool

    def put_many(self, items: Sequence[tuple[OffloadKey, memoryview]]) -> list[Exception | None]: ...

    def get_many(self, items: Sequence[tuple[OffloadKey, memoryview]]) -> list[ObjectHeader | Exception]: ...

    def exists(self, key: OffloadKey) -> bool: ...

    def delete_many(self, keys: Sequence[OffloadKey]) -> None: ...

    def recover(self) -> list[tuple[OffloadKey, int]]: ...

    def close(self) -> None: ...


class FileBlockStore(BlockStore):
    """Objects as files under ``root_dir/<fingerprint>``. Tier type ``file``.

    Args:
        root_dir: the tier's directory (created 0700 with its missing parents).
        fingerprint: the layout fingerprint; it names the namespace directory.
        io_threads: threads of each of the store's pools (writes and deletes; reads), that
            is block operations of each kind run at once.
        fsync: `fsync` each file before renaming it into place (durable across power loss).
        direct_io: use O_DIRECT where the filesystem supports it.
        layout: ``files``, ``segments`` or ``auto`` (see `FileOptions`); `open` settles
            ``auto`` (``layout`` then says which).

    Raises:
        ValueError: `root_dir` is empty or `io_threads` < 1.
    """

    Options = FileOptions
    tier_defaults: ClassVar[dict[str, Any]] = {"max_concurrency": 16, "batch_bytes": 16 << 20}
    verifies_payloads = True  # `objects.read_object` checks the checksum in the thread that read
    reads_in_order = True  # `get_many` reads one file after another, in one pool thread
    supports_integrity = True
    lists_locally = True
    header_align = objects.ALIGN

    @classmethod
    def preflight(
        cls, options: BaseModel, settings: BlockStoreSettings, connect: bool, notes: list[str] | None = None
    ) -> list[str]:
        """Create and remove a file where `root_dir` is, or would be created (its nearest
        existing parent): a path that passes every permission check, under ``/proc`` or
        ``/sys`` or on a read-only mount, fails here rather than at start. `connect` adds
        nothing (the disk is local)."""
        assert isinstance(options, FileOptions)
        root = Path(os.path.expanduser(options.root_dir))
        where = root
        while not os.path.lexists(where) and where != where.parent:
            where = where.parent
        try:
            fd, name = tempfile.mkstemp(prefix=".tiering-check-", dir=where)
            os.close(fd)
            os.unlink(name)
        except OSError as exc:
            return [f"root_dir: {root}: cannot create a file in {where}: {exc.strerror or exc}"]
        return []

    @classmethod
    async def list_namespaces(cls, options: BaseModel, settings: BlockStoreSettings) -> list[NamespaceUsage]:
        """The namespace directories under `root_dir`: files, bytes, newest modification
        (`dirs.namespace_usage`, in a thread)."""
        assert isinstance(options, FileOptions)
        return await anyio.to_thread.run_sync(dirs.namespace_usage, Path(options.root_dir).expanduser())

    @classmethod
    def location(cls, options: Mapping[str, Any]) -> str:
        """``file`` and `root_dir`, absolute, with its links resolved."""
        return f"file {os.path.realpath(options['root_dir'])}"

    @classmethod
    def check_config(cls, options: BaseModel, settings: BlockStoreSettings) -> None:
        """A shared directory keeps one file per block.

        Raises:
            ValueError: ``shared`` with ``layout: segments`` (segments are one engine's).
        """
        assert isinstance(options, FileOptions)
        if options.shared and options.layout == "segments":
            raise ValueError("layout: segments are one engine's; a shared directory keeps one file per block")

    @classmethod
    def from_config(cls, fingerprint: bytes, options: BaseModel, settings: BlockStoreSettings) -> FileBlockStore:
        """A store of the tier's config; `io_threads` defaults to `max_concurrency`."""
        assert isinstance(options, FileOptions)
        threads = options.io_threads or settings.max_concurrency
        layout = "files" if options.shared else options.layout
        store = cls(options.root_dir, fingerprint, threads, options.fsync, options.direct_io, layout)
        store.locality = REMOTE if options.shared else LOCAL
        return store

    def __init__(
        self,
        root_dir: str | os.PathLike[str],
        fingerprint: bytes,
        io_threads: int = 16,
        fsync: bool = False,
        direct_io: bool = True,
        layout: str = "auto",
    ):
        super().__init__(fingerprint)
        if io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {io_threads}")
        if not os.fspath(root_dir):
            raise ValueError("root_dir must not be empty")
        self.root_dir = Path(root_dir).expanduser()
        self.directory = self.root_dir / fingerprint.hex()
        self.fsync = fsync
        self.direct_io = direct_io
        self._io_threads = io_threads
        self._pool: DaemonThreadPool | None = None  # writes, deletes, the scan
        self._read_pool: DaemonThreadPool | None = None  # reads: a promotion never queues behind writes
        self._ns: dirs.Namespace | None = None  # open from `open` to `close`
        self.layout = layout
        self._layout: Layout | None = None  # from `open` to `close`
        self._segments_made = False  # `open` made the segments directory
        self._tidy = True  # `recover` removes what is not a whole object of ours (`for_records`: not)
        self._listing: asyncio.Event | None = None  # the segments' mapping in `recover`, set once it ended

    def __repr__(self) -> str:
        return f"FileBlockStore({str(self.directory)!r})"

    def path(self, key: OffloadKey) -> Path:
        """The file of `key` (for operators and tests: the store itself never uses paths)."""
        return self.directory / dirs.shard(key) / dirs.object_name(key)

    @property
    def _open_ns(self) -> dirs.Namespace:
        self.check_open()
        assert self._ns is not None
        return self._ns

    async def _run(self, func: Callable[..., T], *args: Any, read: bool = False) -> T:
        """``func(*args)`` in one hop to the store's write pool (or its read pool); never
        abandoned once running."""
        self.check_open()
        with anyio.CancelScope(shield=True):
            result = await self._hop(self._read_pool if read else self._pool, func, *args)
        return result

    @staticmethod
    async def _hop(pool: Executor | None, func: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(pool, partial(func, *args))

    async def open(self) -> None:
        """Create (or check) the directories and probe O_DIRECT.

        Raises:
            PermissionError: `root_dir` cannot be written, belongs to another user, or is
                writable by group or others (the message names it and says what to do).
            OSError: `root_dir` cannot be created or is not a directory.
        """
        # daemon threads: a call stuck in a hung mount never keeps the process from exiting
        self._pool = DaemonThreadPool(self._io_threads, "tiering-file")
        try:
            self._ns = await self._hop(self._pool, dirs.open_namespace, self.root_dir, self.directory.name)
            await super().open()
            if self.direct_io and not await self._run(dirs.supports_direct_io, self._open_ns):
                logger.warning("file tier %s: O_DIRECT is not supported here; using buffered I/O", self.directory)
                self.direct_io = False
            log = await self._open_segments()
            ns = self._open_ns
            args = (self.fingerprint, self.seal, self.fsync, self.direct_io, self.block_bytes)
            if log is None:
                await self._run(ns.make_shards)
            self._layout = log or objects.OneFilePerBlock(ns, self.directory, *args)
            if isinstance(self._layout, objects.OneFilePerBlock):
                self._layout.tidy = self._tidy
            if log is None and not self.direct_io:
                self.calls_at_once = CALLS_PER_CPU * len(os.sched_getaffinity(0))
            self.layout = self._layout.name
            reads = min(self._io_threads, self._layout.max_read_threads or self._io_threads)
            self._read_pool = DaemonThreadPool(reads, "tiering-file-read")
        except OSError as exc:
            await self.undo_open()
            raise type(exc)(exc.errno, f"file tier: cannot use {self.directory}: {exc.strerror}") from exc

    async def _open_segments(self) -> segments.SegmentLog | None:
        """For ``segments``, or ``auto`` with blocks under `SEGMENT_BLOCKS_UNDER`, the
        opened segment log (`segments.open_log`); None: one file per block. ``auto`` keeps
        one file per block, in one log line, where the namespace holds one-file objects
        already (removing segments no engine holds: `dirs.remove_unheld`), the filesystem
        cannot punch holes or another engine holds the segments."""
        small = self.block_bytes is not None and self.block_bytes < SEGMENT_BLOCKS_UNDER
        if self.layout == "files" or (self.layout == "auto" and not small):
            return None
        ns = self._open_ns
        path = self.directory / dirs.SEGMENTS
        if self.layout == "auto" and await self._run(dirs.holds_objects, ns):
            logger.info("file tier %s: holds one file per block already; keeping that layout", self.directory)
            if await self._run(dirs.remove_unheld, ns.fd, path):
                logger.warning("file tier %s: removed segments no engine held (their blocks are recomputed)", path)
            return None
        self._segments_made = not os.path.lexists(path)
        args = (ns.fd, path, self.fingerprint, self.seal, self.direct_io, self.fsync)
        try:
            return await self._run(segments.open_log, *args)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EWOULDBLOCK) or self.layout == "segments":
                raise
            logger.warning("file tier %s: %s; one file per block instead", self.directory, exc.strerror)
            return None

    async def close(self) -> None:
        await super().close()
        if self._layout is not None:
            self._layout.close()
            self._layout = None
        for pool in (self._pool, self._read_pool):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        self._pool = self._read_pool = None
        if self._ns is not None:
            self._ns.close()
            self._ns = None

    def for_records(self) -> FileBlockStore:
        """Itself, one file per object and buffered: records are few and small, every engine
        of an identity opens them (segments are one engine's), and opening them writes no
        O_DIRECT probe; its `recover` removes nothing (a listing opens records and lists
        leases: it writes nothing; every record is written whole, by a rename)."""
        self.layout = "files"
        self.direct_io = False
        self._tidy = False
        return self

    async def undo_open(self) -> None:
        """Close, then remove the directories `open` created (the namespace, its segments
        directory, missing parents of `root_dir`) while they are empty."""
        ns, self._ns = self._ns, None
        await self.close()
        if ns is not None:
            await self._hop(None, dirs.remove_created, ns, self._segments_made)

    async def remove_namespace(self) -> None:
        """Remove the namespace directory with everything in it (symbolic links are removed,
        never followed), under its segments' lock: never another engine's live segments
        (`tiering-config prune` opens a store of the namespace apart); one hop to the write pool.

        Raises:
            OSError: EBUSY, another store holds the namespace's segments; a file or directory
                could not be removed (what was removed stays so).
        """
        held_here = isinstance(self._layout, segments.SegmentLog)  # its own segments: removed by itself
        await self._run(dirs.remove_unless_held, self.directory, held_here)

    @property
    def _open_layout(self) -> Layout:
        self.check_open()
        assert self._layout is not None
        return self._layout

    async def put(self, key: OffloadKey, payload: memoryview) -> None:
        if (error := (await self.put_many([(key, payload)]))[0]) is not None:
            raise error

    async def get(self, key: OffloadKey, into: memoryview) -> ObjectHeader:
        if isinstance(outcome := (await self.get_many([(key, into)]))[0], Exception):
            raise outcome
        return outcome

    async def put_many(self, items: Sequence[tuple[OffloadKey, memoryview]]) -> list[Exception | None]:
        """All puts in one hop: one after the other in one pool thread, or in segments one
        vectored write."""
        return await self._run(self._open_layout.put_many, items)

    async def get_many(self, items: Sequence[tuple[OffloadKey, memoryview]]) -> list[ObjectHeader | Exception]:
        """All gets in one hop: one after the other in one pool thread, or in segments one
        vectored read per run of blocks stored side by side."""
        return await self._run(self._open_layout.get_many, items, read=True)

    async def exists(self, key: OffloadKey) -> bool:
        layout = self._open_layout
        return await self._run(layout.exists, key, read=True) if layout.exists_needs_io else layout.exists(key)

    async def delete_many(self, keys: Collection[OffloadKey]) -> None:
        await self._run(self._open_layout.delete_many, list(keys))

    async def recover(self) -> list[tuple[OffloadKey, int]]:
        """What the namespace holds (see `BlockStore.recover`). The segment layout maps its
        segments here, which every other call needs first: they wait in `ready` meanwhile."""
        layout = self._open_layout
        listing = self._listing = asyncio.Event() if isinstance(layout, segments.SegmentLog) else None
        try:
            return await self._run(layout.recover)
        finally:
            if listing is not None:
                listing.set()

    async def ready(self) -> None:
        """While `recover` maps the segments (a million entries take seconds), until it
        ends: the calls that need the map wait here, outside their timeout, instead of in a
        pool thread within it."""
        if self._listing is not None:
            await self._listing.wait()
