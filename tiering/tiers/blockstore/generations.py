"""A lasting tier's generations and manifest, kept in the tier's own store.

The blocks of an identity (`tiering.contract.identity`) live in the namespace of its current
generation, `namespace(identity digest, generation)`. Beside them, in the identity's record
namespace (`record_namespace`), two small objects in the stored format:

- ``~manifest``: the identity in plain words (JSON, `EngineIdentity.manifest` and the
  digest), written by the first engine of the identity to open the tier. It is a label,
  never a gate: the namespaces' names come from the identity itself, so a manifest that does
  not open (torn, planted, sealed by a key since dropped) or names another identity is
  logged, counted (`Records.rewritten`) and written again, and the tier opens all the same;
  one sealed under an older key of the list is sealed again with the current one;
- ``~generation``: the current generation, 8 bytes big-endian; absent means 0.

`reset_cache` (`BlockStoreTier.new_generation`) moves the tier to a new generation: the
record is advanced and the engine's later blocks go to the new namespace, while the old one is
removed in the background; an engine started later reads the record and joins the new
generation, so no block stored before the reset is offered again. Records are written with the
store's `put`, atomic in every store, sealed like the tier's blocks.

Any store works: records are objects of the `BlockStore` contract under reserved keys, in a
namespace no engine's blocks use.

Loop thread: the coroutines (the tier runs them on its event loop). `Records` is built on the
thread that builds the engine.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import secrets
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any

import anyio

from tiering.contract.identity import NAMESPACE_BYTES, namespace
from tiering.contract.keys import OffloadKey
from tiering.errors import CorruptObjectError, ObjectNotFoundError, describe, is_no_space
from tiering.tiers.blockstore.store import BlockStore
from tiering.tiers.object_format import ObjectHeader, open_payload

logger = logging.getLogger(__name__)

GENERATION_KEY = OffloadKey(b"~generation")
MANIFEST_KEY = OffloadKey(b"~manifest")
MANIFEST_BYTES = 64 << 10
SWITCH_RETRY_S = 1.0  # seconds between two tries to open a new generation's store


def record_namespace(identity_digest: bytes) -> bytes:
    """16 bytes naming the namespace of an identity's records (manifest, generation)."""
    return hashlib.blake2b(identity_digest, digest_size=NAMESPACE_BYTES, person=b"kv-records").digest()


class Records:
    """An identity's records in one tier's store, kept open from `open` to `close` (`remove`).

    Args:
        make_store: ``make_store(namespace, blocks)`` builds an unopened store of the tier's
            kind (sealed as the tier's) for a 16-byte namespace, of blocks or of records.
        identity_digest: the engine's `EngineIdentity.digest`.
        manifest: the identity in plain words, or None (a tier built without an engine: no
            manifest is written).
    """

    def __init__(
        self,
        make_store: Callable[[bytes, bool], BlockStore],
        identity_digest: bytes,
        manifest: Mapping[str, Any] | None,
    ):
        self._make_store = make_store
        self.identity_digest = identity_digest
        self.generation = 0  # the current one, once `open` has read it (loop thread after)
        self.created = False  # `open` wrote the manifest: the records are this engine's
        self.rewritten = 0  # records found unreadable, foreign or under an older key, and written again
        self._manifest = None if manifest is None else {"identity": identity_digest.hex(), **manifest}
        self._store: BlockStore | None = None  # the records' store, open from `open` to `close`

    def store(self) -> BlockStore:
        """An unopened store of the current generation's blocks."""
        return self._make_store(namespace(self.identity_digest, self.generation), True)

    async def open_next(self, timeout_s: float) -> BlockStore:
        """(`BlockWorker.start_switch`) `advance`, then open the new generation's store, each
        try within `timeout_s` seconds, tried again every `SWITCH_RETRY_S` seconds until it
        succeeds (or the task is cancelled)."""
        while True:
            try:
                with anyio.fail_after(timeout_s):
                    generation = await self.advance()
                    store = self.store()
                    await store.open()
                logger.info("generation %d of identity %s: %r", generation, self.identity_digest.hex(), store)
                return store
            except Exception as exc:
                logger.warning("cannot open generation %d (%s); retrying", self.generation, describe(exc))
                await asyncio.sleep(SWITCH_RETRY_S)

    async def open(self) -> int:
        """Open the records (kept open until `close`), write the manifest if there is none,
        check it if there is one, and return the current generation (a new one, recorded,
        where the record cannot be read: an unknown generation is never assumed to be an old
        one). On failure, what it created is removed again (`remove`).

        Raises:
            Exception: the store's own errors (it cannot be opened or read).
        """
        store = self._make_store(record_namespace(self.identity_digest), False).for_records()
        if not store.lasting:
            return self.generation
        await store.open()
        self._store = store
        try:
            if self._manifest is not None:
                await self._label(store)
            generation, stale = await _read_int(store, GENERATION_KEY)
            if generation is not None and generation < 0:
                generation = secrets.randbits(62)
                logger.warning("%r: the generation record cannot be read; starting generation %d", store, generation)
                await store.put(GENERATION_KEY, memoryview(generation.to_bytes(8, "big")))
            elif generation is not None and stale:  # sealed by an older key: sealed again before it is dropped
                await store.put(GENERATION_KEY, memoryview(generation.to_bytes(8, "big")))
                self.rewritten += 1
            self.generation = generation or 0
            manifest = json.dumps(self._manifest, sort_keys=True) if self._manifest is not None else "none given"
            logger.info(
                "%r: generation %d of identity %s; manifest %s",
                store,
                self.generation,
                self.identity_digest.hex(),
                manifest,
            )
            return self.generation
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.remove()
            raise

    async def advance(self) -> int:
        """Record a generation after the current one, make it current and return it: the
        record's own if another engine of this identity moved past the current one already
        (replicas reset together join one generation), else the next.

        Raises:
            Exception: the store's own errors.
        """
        if self._store is None:
            self.generation += 1
            return self.generation
        recorded, _ = await _read_int(self._store, GENERATION_KEY)
        generation = max(self.generation + 1, recorded or 0)
        await self._store.put(GENERATION_KEY, memoryview(generation.to_bytes(8, "big")))
        self.generation = generation
        return generation

    async def remove(self) -> None:
        """Close the records; where this engine created them and never reset (a failed start,
        a benchmark's run: nothing another engine relies on), remove them first, and what
        opening their store created (`BlockStore.undo_open`: an empty namespace, missing
        parents of a file tier's root).

        Raises:
            Exception: the store's own errors (it is closed anyway).
        """
        store, self._store = self._store, None
        if store is None:
            return
        if not (self.created and self.generation == 0):
            await store.close()
            return
        try:
            await store.delete_many([MANIFEST_KEY, GENERATION_KEY])
        finally:
            await store.undo_open()

    async def close(self, remove: bool = False) -> None:
        """Close the records' store, or `remove` them (with `remove`); a failure is logged.
        Nothing after the first call."""
        try:
            if remove:
                await self.remove()
            elif (store := self._store) is not None:
                self._store = None
                await store.close()
        except Exception as exc:
            logger.warning("could not close the records of identity %s: %s", self.identity_digest.hex(), describe(exc))

    async def _label(self, store: BlockStore) -> None:
        """Write this engine's manifest where there is none, or where the one there does not
        open, names another identity (logged, counted) or was sealed by an older key; never
        raises for what the manifest holds."""
        assert self._manifest is not None
        try:
            manifest, stale = await _read_manifest(store)
        except (CorruptObjectError, ValueError) as exc:  # ForgedObjectError included
            self.rewritten += 1
            logger.warning("%r: its manifest cannot be read (%s): written again, blocks read as before", store, exc)
            manifest, stale = None, True
        if manifest is not None and manifest.get("identity") != self.identity_digest.hex():
            self.rewritten += 1
            logger.warning(
                "%r: its manifest names identity %s, not this engine's %s: written again, blocks read as before",
                store,
                manifest.get("identity"),
                self.identity_digest.hex(),
            )
            manifest, stale = None, True
        if manifest is not None and not stale:
            return
        try:
            await store.put(MANIFEST_KEY, memoryview(manifest_text(self._manifest)))
        except OSError as exc:
            if not is_no_space(exc):
                raise
            logger.warning("%r: no room for the manifest (%s); the next start writes it", store, describe(exc))
            return  # the blocks' namespace is the identity's all the same
        if manifest is None and not stale:
            self.created = True
        elif manifest is not None:  # a readable one under an older key: sealed again
            self.rewritten += 1


def manifest_text(manifest: Mapping[str, Any]) -> bytes:
    """`manifest` as the stored record: indented JSON, padded with spaces to
    `MANIFEST_BYTES` (a record of one size, read in one call); the layer names are left out
    of a manifest too long for that."""
    text = json.dumps(manifest, sort_keys=True, indent=1).encode()
    if len(text) > MANIFEST_BYTES:
        short = {**manifest, "groups": f"{len(manifest.get('groups', ()))} groups, too many layer names to list"}
        text = json.dumps(short, sort_keys=True, indent=1).encode()[:MANIFEST_BYTES]
    return text.ljust(MANIFEST_BYTES)


async def read_records(store: BlockStore) -> tuple[dict[str, Any], int] | None:
    """The manifest and current generation an opened records store holds, or None where it
    holds no readable manifest (not an identity's records, or torn, or sealed by others).

    Raises:
        Exception: the store's own errors.
    """
    try:
        manifest, _ = await _read_manifest(store)
    except (CorruptObjectError, ValueError):
        return None
    if manifest is None:
        return None
    return manifest, (await _read_int(store, GENERATION_KEY))[0] or 0


async def _read_manifest(store: BlockStore) -> tuple[dict[str, Any] | None, bool]:
    """The manifest an opened records store holds (None if it holds none), and whether it
    was sealed by another key than the one the store seals with now (`_stale`).

    Raises:
        CorruptObjectError: it is torn, or its seal does not open.
        ValueError: it is not a JSON object.
        Exception: the store's own errors.
    """
    into = bytearray(MANIFEST_BYTES)
    try:
        header = await store.get(MANIFEST_KEY, memoryview(into))
    except ObjectNotFoundError:
        return None, False
    open_payload(header, memoryview(into), store.seal)
    manifest = json.loads(into)
    if not isinstance(manifest, dict):
        raise ValueError("the manifest is not a JSON object")
    return manifest, _stale(header, store)


async def _read_int(store: BlockStore, key: OffloadKey) -> tuple[int | None, bool]:
    """The 8-byte record `key` (None if absent, -1 if it cannot be read: torn, foreign), and
    whether it was sealed by another key than the current one (`_stale`)."""
    into = bytearray(8)
    try:
        header = await store.get(key, memoryview(into))
        open_payload(header, memoryview(into), store.seal)
    except ObjectNotFoundError:
        return None, False
    except CorruptObjectError:  # ForgedObjectError included
        return -1, False
    return int.from_bytes(into, "big"), _stale(header, store)


def _stale(header: ObjectHeader, store: BlockStore) -> bool:
    """Whether an object that opened was sealed by a key of the list other than the first, the
    one the store seals with: it must be sealed again before that key is dropped."""
    return store.seal is not None and header.sealed is not None and header.sealed.key_id != store.seal.key_id


class CurrentStore:
    """The store of a tier's current generation (`store`), and its moves to the next one at
    resets (`switch`); jobs started while one opens run on it once it is open (`ready`, `of`).
    Loop thread."""

    def __init__(self, records: Records):
        self.records = records
        self.store = records.store()  # generation 0's until `Records.open` has read the current one
        self._switched: anyio.Event | None = None  # set once the last reset's generation is current

    def ready(self) -> BlockStore | anyio.Event:
        """What a job started now runs on: the current store, or, while a new generation's
        opens, the event set once it is current."""
        switched = self._switched
        return self.store if switched is None or switched.is_set() else switched

    async def of(self, ready: BlockStore | anyio.Event) -> BlockStore:
        """The store `ready` (from `ready`) names, once it is open."""
        if isinstance(ready, anyio.Event):
            await ready.wait()
            return self.store
        return ready

    def switch(
        self, open_next: Callable[[], Awaitable[BlockStore]], old_tasks: set[asyncio.Task[Any]]
    ) -> Coroutine[Any, Any, None]:
        """The task that moves to the store `open_next` opens (`Records.open_next`), after the
        generation of a reset before it, then retires the old store once `old_tasks` (its jobs
        and calls) have ended (`retire`)."""
        previous, self._switched = self._switched, anyio.Event()
        return self._switch(open_next, previous, self._switched, old_tasks)

    async def _switch(
        self,
        open_next: Callable[[], Awaitable[BlockStore]],
        previous: anyio.Event | None,
        switched: anyio.Event,
        old_tasks: set[asyncio.Task[Any]],
    ) -> None:
        if previous is not None:
            await previous.wait()
        old, self.store = self.store, await open_next()
        switched.set()
        await retire(old, old_tasks)


async def retire(old: BlockStore, tasks: set[asyncio.Task[Any]]) -> None:
    """Once `tasks` (the jobs and calls of `old`, a previous generation's store) have ended,
    remove its namespace (a failure is logged) and close it."""
    try:
        if tasks:
            await asyncio.wait(tasks)
        await old.remove_namespace()
        logger.info("removed the namespace of a previous generation, %r", old)
    except Exception as exc:
        logger.warning("could not remove the namespace of a previous generation, %r: %s", old, describe(exc))
    finally:
        with anyio.CancelScope(shield=True):
            await old.close()
