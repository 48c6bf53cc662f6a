"""`BlockStore`: the async interface a storage backend implements to become a tier.

Loop thread: every coroutine runs on the tier's event loop. The class attributes and
`from_config` are read on the thread that builds the engine.

A store declares its config keys as a pydantic model, `Options`, and may change the
defaults of the adapter's own keys (`BlockStoreSettings`: capacity, concurrency, timeouts,
batching, probing, health) with `tier_defaults`. Registered under a type name (entry point
group ``tiering.secondary_tiers``), the store becomes a tier with the keys of both.

A store keeps one object per key in the format of `tiering.tiers.object_format` (it writes what
`encode_object` returns on put, and calls `parse_header` and `check_length` on get), under
the namespace of its layout fingerprint. A store moves bytes; the payload's checksum (or
signature) is checked above every store layer, by the adapter, so a wrapping store
(`tiering.backends.faulty`) is checked too, unless the outermost store checks it itself as it
reads (`verifies_payloads`). A store that passes its `seal` to those functions says so
(`supports_integrity`), and tiers of it may then sign or encrypt their objects
(`tiering.tiers.seal`).

All coroutines run on the tier's event loop; a store may move the blocking part of an
operation to its own threads, one hop per operation. The adapter
`tiering.tiers.blockstore.BlockStoreTier` owns the index, capacity, eviction and concurrency, so
a store does no bookkeeping of its own.

Errors: a missing object raises `ObjectNotFoundError`, one that fails verification
`CorruptObjectError` (`ForgedObjectError` when its seal does not open), any use outside
open..close `StoreClosedError`; anything else (OSError, timeouts, client errors) counts as
a transient failure of that operation.
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import anyio
from pydantic import BaseModel

from tiering.contract.keys import OffloadKey
from tiering.contract.mediums import LOCAL
from tiering.errors import StoreClosedError, describe
from tiering.options import NoOptions
from tiering.stats import Every
from tiering.tiers.object_format import HEADER_ALIGN, ObjectHeader

if TYPE_CHECKING:
    from tiering.tiers.blockstore.settings import BlockStoreSettings
    from tiering.tiers.seal import Seal

logger = logging.getLogger(__name__)

PROGRESS_INTERVAL_S = 5.0  # seconds between two progress lines of a long `recover`


@dataclass(frozen=True)
class NamespaceUsage:
    """One namespace a store's root holds (`BlockStore.list_namespaces`): its 16-byte name,
    its objects (a file tier's files: a segment holds many blocks; temporaries of writes are
    not objects) and their bytes, the newest object's write in Unix seconds (None: unknown),
    and whether it holds an identity's manifest (None: the lister cannot tell without
    reading it; a listing opens only those that may hold one)."""

    namespace: bytes
    objects: int
    bytes: int
    last_write: float | None
    holds_manifest: bool | None = None


def namespace_named(name: str) -> bytes | None:
    """The 16-byte namespace a directory or prefix `name` names (32 lowercase hex digits, as
    stores name them), or None: not a namespace."""
    if len(name) != 32 or name.lower() != name:
        return None
    try:
        return bytes.fromhex(name)
    except ValueError:
        return None


class BlockStore(ABC):
    """Objects by key: put from a memoryview, get into a memoryview.

    Attributes:
        Options: the pydantic model of the store's own config keys (default: none).
        tier_defaults: defaults of `BlockStoreSettings` keys for tiers of this store, for
            example ``{"max_concurrency": 64}``; the config may still set each key.
        header_align: the store pads object headers to a multiple of this many bytes.
        evicts_itself: True for a backend that evicts by its own policy (a cache server's
            ``maxmemory``): an absent object is simply a miss, and a store refused for lack
            of room (ENOSPC) fails alone, without the tier holding back or evicting to make
            room, since room comes back as the server evicts.
        verifies_payloads: True when `get` and `get_many` check the payload's XXH3-64
            themselves (`verify_payload`, raising `CorruptObjectError`), in the thread that
            read it while it is still in the CPU's cache; the adapter then skips its own
            check, which would read every byte once more on the loop thread. A store that
            wraps another (and may change bytes the inner one checked) leaves it False.
        reads_in_order: True when `get_many` reads its items one after another (the file
            store: one pool thread per call). The adapter then hands a promotion that is the
            tier's only load in flight over in calls of about `LOAD_SPREAD_MIN_BYTES`, a few
            at a time, so that its rows land (and are copied to the GPU) call after call
            instead of all at the end; a store that reads a call's items concurrently gets
            fewer, larger calls.
        calls_at_once: None, or how many of its calls can run at once to any gain, because
            each keeps a CPU busy (the file store's buffered calls: a copy and a checksum per
            block). The adapter then sends the blocks of jobs started together (unless a
            promotion is spread) in no more calls than this, each larger than ``batch_bytes``
            if need be: more calls would only take turns on the same CPUs, and cost a hop
            each. Set by `open` or before.
        lasting: False for a store whose objects die with the engine (the ``memory`` store):
            it keeps no records of generations (`tiering.tiers.blockstore.generations`).
        lists_locally: True where `list_namespaces` reaches nothing remote (the file
            store): ``tiering-config check`` lists its namespaces without ``--connect``.
        supports_integrity: True when the store passes `seal` to `encode_object`,
            `parse_header` and `verify_payload` (a store that checks headers when it
            recovers may reclaim the objects whose seal does not open, `ForgedObjectError`:
            a namespace is one deployment's); only then may its tiers take the
            ``integrity`` key.
        seal: the tier's `tiering.tiers.seal.Seal`, set by the adapter before `open`, or None for
            a tier without integrity keys.
        block_bytes: the bytes of the tier's blocks (a primary row), set by the adapter before
            `open`, or None where the store is used without a tier (tests, tools).
        locality: where its blocks are for the tier's KV events (`tiering.tiers.events`):
            `LOCAL` on this machine (the default), `REMOTE` reached over the network or shared
            with other engines (S3, Valkey, a file tier marked ``shared``).
        places_locally: True where some objects of a `REMOTE` store may sit in this engine's
            own memory (a Mooncake pool the engine lends a segment to): after a store, the
            tier asks `local_keys` which did, and announces those `LOCAL`. Set by `open`.
    """

    Options: ClassVar[type[BaseModel]] = NoOptions
    tier_defaults: ClassVar[Mapping[str, Any]] = {}
    header_align = HEADER_ALIGN
    evicts_itself: ClassVar[bool] = False
    verifies_payloads: ClassVar[bool] = False
    reads_in_order: ClassVar[bool] = False
    calls_at_once: int | None = None
    supports_integrity: ClassVar[bool] = False
    lasting: ClassVar[bool] = True
    lists_locally: ClassVar[bool] = False
    locality: str = LOCAL
    places_locally: bool = False

    @classmethod
    def from_config(cls, fingerprint: bytes, options: BaseModel, settings: BlockStoreSettings) -> BlockStore:
        """The store a tier config describes: `options` (an `Options`, validated) and the
        tier's `settings`. The default passes the options as keyword arguments,
        ``cls(fingerprint, **options)``; a store whose arguments differ overrides it.
        Nothing is opened yet.

        Raises:
            ValueError: an option does not fit.
        """
        return cls(fingerprint, **dict(options))

    @classmethod  # noqa: B027 - an optional hook, empty by default
    def check_config(cls, options: BaseModel, settings: BlockStoreSettings) -> None:
        """Rules between the store's options and the tier's settings, checked when a config
        is loaded, before anything is built. Default: none.

        Raises:
            ValueError: a rule is broken (the message says which keys and why).
        """

    @classmethod
    def preflight(
        cls, options: BaseModel, settings: BlockStoreSettings, connect: bool, notes: list[str] | None = None
    ) -> list[str]:
        """What would keep a tier of this store from starting, found by ``tiering-config
        check`` before the engine is built: one line per problem (empty: none found). Without
        `connect`, only what is cheap and local (a store overrides it: the file store creates
        and removes a file where its objects go, the S3 store resolves its credentials); with
        `connect`, the store is also opened, pinged and closed as the engine would, within
        ``open_timeout_s`` (a store that creates what it lacks, an S3 bucket with
        ``create_bucket``, creates it), and its `caveats` are added to `notes` (where given).
        Never raises."""
        if not connect:
            return []
        store = cls.from_config(bytes(16), options, settings)

        async def reach() -> None:
            await store.open()
            try:
                await store.ping()
                if notes is not None:
                    notes.extend(await store.caveats())
            finally:
                await store.close()

        try:
            asyncio.run(asyncio.wait_for(reach(), settings.open_timeout_s))
        except TimeoutError:
            return [f"no answer in {settings.open_timeout_s} s (open_timeout_s)"]
        except Exception as exc:
            return [f"cannot be reached: {describe(exc)}"]
        return []

    async def caveats(self) -> list[str]:
        """What the open store's server is set to that lets it drop what the engine keeps
        without an expiry (records, leases) on its own, one line each, for ``tiering-config
        check --connect`` to print (a warning, not a problem: the engine starts). Default:
        none. Never raises."""
        return []

    @classmethod
    async def list_namespaces(cls, options: BaseModel, settings: BlockStoreSettings) -> list[NamespaceUsage] | None:
        """Every namespace under the root a tier configured with `options` keeps its objects
        in (a file tier's ``root_dir``, an S3 prefix), for ``tiering-config``: it reaches the
        storage itself (as the engine would open it) and creates nothing. None: this store
        does not list them (the default; the ``memory`` store's die with the engine, a
        Valkey server evicts by its own memory policy).

        Raises:
            Exception: the store's own errors (it cannot be reached or listed).
        """
        return None

    @classmethod
    def location(cls, options: Mapping[str, Any]) -> str | None:
        """Where the objects of a tier configured with `options` (its validated config keys)
        live, as text that is equal for two configs that would share them (``file
        /srv/kv``); the config is refused when two tiers of one engine share one: each would
        evict, and recover, the other's blocks. Checked at config load. Default: None (no
        check)."""
        return None

    def __init__(self, fingerprint: bytes):
        """`fingerprint`: the 16-byte layout fingerprint written into, and expected in, every
        object (see `tiering.tiers.object_format.layout_fingerprint`)."""
        self.fingerprint = fingerprint
        self.seal: Seal | None = None
        self.block_bytes: int | None = None
        self._open = False

    async def open(self) -> None:
        """Connect or create what the store needs. Called once, before anything else.

        Raises:
            OSError: the backing storage is not usable (the message says why).
        """
        self._open = True

    async def close(self) -> None:
        """Release connections, threads and files. Later calls do nothing."""
        self._open = False

    def check_open(self) -> None:
        """Raises `StoreClosedError` unless the store is open."""
        if not self._open:
            raise StoreClosedError(f"{type(self).__name__} is not open")

    @abstractmethod
    async def put(self, key: OffloadKey, payload: memoryview) -> None:
        """Store `payload` (a 1-D contiguous buffer) under `key`, atomically: a reader sees
        the old object, the new one, or none, never a mix. Replaces an existing object."""

    @abstractmethod
    async def get(self, key: OffloadKey, into: memoryview) -> ObjectHeader:
        """Read the payload of `key`'s object into `into` (exactly its length) and return
        the object's header. The header and the length are checked; the checksum or signature
        is the caller's to check (`tiering.tiers.object_format.verify_payload`), unless the store
        `verifies_payloads`; an encrypted payload is left encrypted, for the caller.

        `into` may hold garbage when this raises, and until the checksum is checked.

        Raises:
            ObjectNotFoundError: no object for `key`.
            CorruptObjectError: the header or the length is wrong.
            UnusableObjectError: this object cannot be read for a reason of its own, not the
                backend's (a file's permissions or media error, an S3 object archived to a
                storage class that cannot be read): the tier drops the key and deletes the
                object, and the failure does not count against the tier's health.
            ForgedObjectError: the header's seal is not one `seal` opens.
            Exception: anything else is the backend's failure (it counts towards the breaker).
        """

    async def put_many(self, items: Sequence[tuple[OffloadKey, memoryview]]) -> list[Exception | None]:
        """`put` each (key, payload); returns, per item, None or the exception it raised.

        The default runs the puts concurrently; a store whose operations block a thread
        overrides it to do the whole batch in one hop.
        """
        return await _each(self.put, items)

    async def get_many(self, items: Sequence[tuple[OffloadKey, memoryview]]) -> list[ObjectHeader | Exception]:
        """`get` each (key, into); returns, per item, its header or the exception it raised."""
        return await _each(self.get, items)

    @abstractmethod
    async def exists(self, key: OffloadKey) -> bool:
        """Whether an object for `key` exists (it is not read or verified)."""

    async def exists_many(self, keys: Sequence[OffloadKey]) -> list[bool | Exception]:
        """`exists` of each key; returns, per key, the answer or the exception it raised.

        The default checks the keys concurrently; a store with a cheaper way to ask for many
        (a pipeline) overrides it.
        """
        return await _each(self.exists, [(key,) for key in keys])

    async def local_keys(self, keys: Sequence[OffloadKey]) -> set[OffloadKey]:
        """Of `keys` (stored), those whose objects sit in this engine's own memory; asked only
        where `places_locally`. Default: none.

        Raises:
            OSError: the store cannot say (the tier then announces them at its `locality`).
        """
        return set()

    @abstractmethod
    async def delete_many(self, keys: Collection[OffloadKey]) -> None:
        """Delete the objects of `keys`; missing ones are ignored."""

    async def ping(self) -> None:
        """Cheap request that succeeds only if the store is reachable and usable; the health
        breaker sends it before resuming I/O. Default: an existence check.

        Raises:
            Exception: the store is not usable (any error counts).
        """
        await self.exists(OffloadKey(b"tiering-health-probe"))

    @abstractmethod
    async def recover(self) -> list[tuple[OffloadKey, int]]:
        """Every object a previous run left, as (key, object bytes), oldest first.

        Called once after `open`. Headers are checked (not payloads) where the listing has
        them; objects that fail, leftovers of interrupted writes, and objects whose seal does
        not open (sealed by a key dropped from ``integrity``, or planted) are left out and
        deleted (nothing else would give their space back).
        """

    async def ready(self) -> None:
        """Return once a call made now would not wait for the store's own start-up work (the
        file store's segment layout maps its segments in `recover` before any other call can
        run): the tier awaits it before a call's ``op_timeout_s`` starts, so that a long
        listing is never taken for a hung call. Default: at once. Loop thread.

        Raises:
            Exception: a store's bug only: the calls that waited fail with it.
        """
        return None

    def for_records(self) -> BlockStore:
        """The store that keeps this one's records (`tiering.tiers.blockstore.generations`):
        itself, or the store it wraps (`tiering.backends.faulty` injects its faults into the
        blocks' I/O, not the records')."""
        return self

    async def undo_open(self) -> None:
        """Remove what `open` created in the backing storage while it still holds nothing
        (an empty directory tree), and close: for an engine whose start failed after this
        store opened. Anything another process stored since stays. Default: `close`."""
        await self.close()

    async def remove_namespace(self) -> None:
        """Delete every object of this store's namespace, and the namespace itself where the
        backend has one (a directory). Called with no other operation in flight; afterwards
        the store is only closed. Default: `recover`, then `delete_many` of what it lists.

        Raises:
            Exception: as `delete_many`; what was deleted stays deleted.
        """
        await self.delete_many([key for key, _ in await self.recover()])


class RecoveryProgress:
    """Logs how far a long `BlockStore.recover` has got, at most every `PROGRESS_INTERVAL_S`
    seconds (INFO), so that recovering a large tier is not minutes of silence. Used from the
    one thread or task that recovers."""

    def __init__(self, what: str):
        """`what` names the store in the log line (``file tier /mnt/kv/ab12...``)."""
        self._what = what
        self._every = Every(PROGRESS_INTERVAL_S)
        self.count = 0

    def add(self, objects: int = 1) -> None:
        """Count `objects` more objects looked at; log if the interval has passed."""
        self.count += objects
        if self._every.due():
            elapsed = self._every.elapsed()
            logger.info("%s: recovering, %d objects looked at in %.0f s", self._what, self.count, elapsed)


async def _each(operation: Callable[..., Awaitable[Any]], items: Sequence[tuple[Any, ...]]) -> list[Any]:
    """operation(*item) for each item, concurrently: its result, or the exception it raised."""
    if len(items) == 1:  # no task group: a store called one block at a time pays for none
        try:
            return [await operation(*items[0])]
        except Exception as exc:
            return [exc]
    outcomes: list[Any] = [None] * len(items)

    async def run(i: int) -> None:
        try:
            outcomes[i] = await operation(*items[i])
        except Exception as exc:
            outcomes[i] = exc

    async with anyio.create_task_group() as task_group:
        for i in range(len(items)):
            task_group.start_soon(run, i)
    return outcomes
