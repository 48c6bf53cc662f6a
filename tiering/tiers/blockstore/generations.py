"""The weights a lasting tier's blocks were computed with, and the identity's records.

The blocks of an identity (`tiering.contract.identity`) computed with one version of the
weights live in ``namespace(identity digest, weights)``: a function of the two alone, so
replicas that run one version share a namespace however and whenever each got there, and
replicas on different versions never do, with no counter to agree on. The weights are the
version the deployment declares: at start the config's ``weight_version`` (none: the
checkpoint's, `CHECKPOINT`), at a reset the version given to `reset_cache`. A reset that
declares none moves the engine to a namespace of its own (a random label no other engine can
reach), logged once: its blocks are not shared until a restart or a declared version.

Beside the blocks, in the identity's record namespace (`record_namespace`), two small objects
in the stored format, both labels for people and tools (``tiering-config check``), never
gates: nothing written there moves an engine to another namespace.

- ``~manifest``: the identity in plain words (JSON, `EngineIdentity.manifest` and the
  digest), written by the first engine of the identity to open the tier. A manifest that does
  not open (torn, planted, sealed by a key since dropped) or names another identity is
  logged, counted (`Records.rewritten`) and written again, and the tier opens all the same;
  one sealed under an older key of the list is sealed again with the current one;
- ``~versions``: the weight versions engines of the identity declared (JSON, the latest
  `MAX_VERSIONS_LISTED`), so that a listing names their namespaces.

A reset moves the tier to the new weights' namespace on the tier's loop; the old namespace
stays for the replicas that still run its weights, unless it was this engine's own (a reset
without a version before), which is removed once its last jobs have ended. Records are
written with the store's `put`, atomic in every store, sealed like the tier's blocks.

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

from tiering.contract.identity import CHECKPOINT, MAX_WEIGHT_VERSION_CHARS, NAMESPACE_BYTES, namespace
from tiering.contract.keys import OffloadKey
from tiering.errors import CorruptObjectError, ObjectNotFoundError, describe, is_no_space
from tiering.tiers.blockstore.leases import Lease, lease_namespace
from tiering.tiers.blockstore.store import BlockStore
from tiering.tiers.object_format import ObjectHeader, open_payload

logger = logging.getLogger(__name__)

MANIFEST_KEY = OffloadKey(b"~manifest")
MANIFEST_BYTES = 64 << 10
VERSIONS_KEY = OffloadKey(b"~versions")
MAX_VERSIONS_LISTED = 64
VERSIONS_BYTES = MAX_VERSIONS_LISTED * (2 * MAX_WEIGHT_VERSION_CHARS + 4) + 2  # the longest list, as JSON
SWITCH_RETRY_S = 1.0  # seconds between two tries to open a new namespace's store
_told_unshared: set[bytes] = set()  # identities whose reset without a version was logged


def record_namespace(identity_digest: bytes) -> bytes:
    """16 bytes naming the namespace of an identity's records (manifest, versions)."""
    return hashlib.blake2b(identity_digest, digest_size=NAMESPACE_BYTES, person=b"kv-records").digest()


class Records:
    """An identity's records in one tier's store, kept open from `open` to `close` (`remove`),
    and the weights whose namespace holds the engine's blocks (`weights`, `store`).

    Args:
        make_store: ``make_store(namespace, blocks)`` builds an unopened store of the tier's
            kind (sealed as the tier's) for a 16-byte namespace, of blocks or of records.
        identity_digest: the engine's `EngineIdentity.digest`.
        manifest: the identity in plain words, or None (a tier built without an engine: no
            manifest is written).
        weights: the weights' version the engine starts with (`CHECKPOINT`: none declared).
    """

    def __init__(
        self,
        make_store: Callable[[bytes, bool], BlockStore],
        identity_digest: bytes,
        manifest: Mapping[str, Any] | None,
        weights: str = CHECKPOINT,
    ):
        self._make_store = make_store
        self.identity_digest = identity_digest
        self.weights = weights  # the version in force (loop thread after `open`)
        self.shared = True  # False: `weights` is a label of this engine's own (a reset without a version)
        self.switched = False  # a reset moved the engine since it started
        self.created = False  # `open` wrote the manifest: the records are this engine's
        self.rewritten = 0  # records found unreadable, foreign or under an older key, and written again
        self._manifest = None if manifest is None else {"identity": identity_digest.hex(), **manifest}
        self._store: BlockStore | None = None  # the records' store, open from `open` to `close`
        self.lease: Lease | None = None  # this engine's lease on the namespaces it uses, from `open` to `close`

    def store(self) -> BlockStore:
        """An unopened store of the namespace of the weights in force."""
        return self._make_store(namespace(self.identity_digest, self.weights), True)

    def describe_weights(self) -> str:
        """The weights in force, in words, for log lines."""
        if not self.shared:
            return "weights of this engine's own (a reset without a declared version)"
        return f"weight version {self.weights!r}" if self.weights != CHECKPOINT else "the checkpoint's weights"

    async def open_next(self, weights: str | None, timeout_s: float) -> BlockStore:
        """(`BlockWorker.start_switch`) Make `weights` the version in force (None: a label of
        this engine's own, logged once per identity), list it in the records, and open its
        namespace's store, each try within `timeout_s` seconds, tried again every
        `SWITCH_RETRY_S` seconds until it succeeds (or the task is cancelled)."""
        self.switched = True
        self.weights, self.shared = (weights, True) if weights is not None else (secrets.token_hex(16), False)
        if not self.shared and self.identity_digest not in _told_unshared:
            _told_unshared.add(self.identity_digest)
            logger.warning(
                "a reset without a declared weight version: identity %s stores to a namespace of this engine's own, "
                "not shared until restart or a declared version (reset_cache(weight_version=...))",
                self.identity_digest.hex(),
            )
        if self.lease is not None:  # before it is opened: a prune never removes it from under the engine
            await self.lease.hold(namespace(self.identity_digest, self.weights), self.describe_weights())
        while True:
            try:
                with anyio.fail_after(timeout_s):
                    await self._list_version()
                    store = self.store()
                    await store.open()
                logger.info("identity %s: %s: %r", self.identity_digest.hex(), self.describe_weights(), store)
                return store
            except Exception as exc:
                logger.warning("cannot open the namespace of %s (%s); retrying", self.describe_weights(), describe(exc))
                await asyncio.sleep(SWITCH_RETRY_S)

    async def open(self) -> None:
        """Open the records (kept open until `close`), write the manifest where there is none
        or the one there does not open (`_label`), and list the weights in force. On
        failure, what it created is removed again (`remove`).

        Raises:
            Exception: the store's own errors (it cannot be opened or read).
        """
        store = self._make_store(record_namespace(self.identity_digest), False).for_records()
        if not store.lasting:
            return
        await store.open()
        self._store = store
        try:
            if self._manifest is not None:
                await self._label(store)
            await self._list_version()
            self.lease = Lease(self._make_store(lease_namespace(self.identity_digest), False).for_records())
            await self.lease.open(namespace(self.identity_digest, self.weights), self.describe_weights())
            manifest = json.dumps(self._manifest, sort_keys=True) if self._manifest is not None else "none given"
            logger.info(
                "%r: %s of identity %s; manifest %s",
                store,
                self.describe_weights(),
                self.identity_digest.hex(),
                manifest,
            )
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.remove()
            raise

    async def _list_version(self) -> None:
        """Add the declared weights in force to ``~versions`` (the latest `MAX_VERSIONS_LISTED`),
        where they are not listed (nothing for the checkpoint's weights or a label of this
        engine's own); write the list again where it does not open or was sealed by an older
        key. A label, read back by listings: a lost update loses a label only, and a store
        that cannot read or write it (a full disk, a read-only bucket) is logged, never a
        reason for the tier not to open or move to the weights' namespace."""
        store = self._store
        if store is None:
            return
        try:
            await self._update_versions(store)
        except Exception as exc:
            logger.warning("%r: the list of weight versions was not written (%s): a label only", store, describe(exc))

    async def _update_versions(self, store: BlockStore) -> None:
        """`_list_version`'s read and write of ``~versions``.

        Raises:
            Exception: the store's own errors.
        """
        adding = self.shared and self.weights != CHECKPOINT
        try:
            versions, stale = await _read_versions(store)
        except (CorruptObjectError, ValueError) as exc:
            self.rewritten += 1
            logger.warning("%r: its list of weight versions cannot be read (%s): written again", store, exc)
            versions, stale, unreadable = [], True, True
        else:
            unreadable = False
        if not stale and (not adding or self.weights in versions):
            return
        if adding:
            others = [v for v in versions if v != self.weights]
            versions = [*others[len(others) - MAX_VERSIONS_LISTED + 1 :], self.weights]
        await store.put(VERSIONS_KEY, memoryview(json.dumps(versions).encode().ljust(VERSIONS_BYTES)))
        if stale and not unreadable:  # a readable list under an older key: sealed again
            self.rewritten += 1

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
        lease, self.lease = self.lease, None
        if lease is not None:
            await lease.close()
        if not self.created or self.switched:
            await store.close()
            return
        try:
            await store.delete_many([MANIFEST_KEY, VERSIONS_KEY])
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
                lease, self.lease = self.lease, None
                if lease is not None:
                    await lease.close()
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


async def read_records(store: BlockStore) -> tuple[dict[str, Any], list[str]] | None:
    """The manifest and the declared weight versions an opened records store holds, or None
    where it holds no readable manifest (not an identity's records, or torn, or sealed by
    others). An unreadable list of versions reads as none.

    Raises:
        Exception: the store's own errors.
    """
    try:
        manifest, _ = await _read_manifest(store)
    except (CorruptObjectError, ValueError):
        return None
    if manifest is None:
        return None
    try:
        versions, _ = await _read_versions(store)
    except (CorruptObjectError, ValueError):
        versions = []
    return manifest, versions


async def _read_versions(store: BlockStore) -> tuple[list[str], bool]:
    """The weight versions an opened records store lists (none if it lists none), and
    whether the list was sealed by another key than the current one (`_stale`).

    Raises:
        CorruptObjectError: it is torn, or its seal does not open.
        ValueError: it is not a JSON list of texts.
        Exception: the store's own errors.
    """
    into = bytearray(VERSIONS_BYTES)
    try:
        header = await store.get(VERSIONS_KEY, memoryview(into))
    except ObjectNotFoundError:
        return [], False
    open_payload(header, memoryview(into), store.seal)
    versions = json.loads(into)
    if not isinstance(versions, list) or not all(isinstance(v, str) for v in versions):
        raise ValueError("the list of weight versions is not a JSON list of texts")
    return versions, _stale(header, store)


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


def _stale(header: ObjectHeader, store: BlockStore) -> bool:
    """Whether an object that opened was sealed by a key of the list other than the first, the
    one the store seals with: it must be sealed again before that key is dropped."""
    return store.seal is not None and header.sealed is not None and header.sealed.key_id != store.seal.key_id


class CurrentStore:
    """The store of the namespace of the weights in force (`store`), and its moves to another
    at resets (`switch`); jobs started while one opens run on it once it is open (`ready`,
    `of`). Loop thread."""

    def __init__(self, records: Records):
        self.records = records
        self.store = records.store()
        self._switched: anyio.Event | None = None  # set once the last reset's namespace is current

    def ready(self) -> BlockStore | anyio.Event:
        """What a job started now runs on: the current store, or, while a new namespace's
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
        move of a reset before it, then retires the old store once `old_tasks` (its jobs and
        calls) have ended (`retire`: its namespace removed where it was this engine's own)."""
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
        own = not self.records.shared  # the old namespace: no other engine can reach it
        old, self.store = self.store, await open_next()
        switched.set()
        await retire(old, old_tasks, remove=own)
        if self.records.lease is not None:
            await self.records.lease.release(old.fingerprint)


async def retire(old: BlockStore, tasks: set[asyncio.Task[Any]], remove: bool) -> None:
    """Once `tasks` (the jobs and calls of `old`, the store of the weights before a reset)
    have ended, remove its namespace where `remove` (a failure is logged) and close it. A
    namespace of declared weights, or the checkpoint's, stays for the replicas that still run
    them (`tiering-config prune` removes it once unused)."""
    try:
        if tasks:
            await asyncio.wait(tasks)
        if remove:
            await old.remove_namespace()
            logger.info("removed the namespace of this engine's own weights before a reset, %r", old)
    except Exception as exc:
        logger.warning("could not remove the namespace of weights before a reset, %r: %s", old, describe(exc))
    finally:
        with anyio.CancelScope(shield=True):
            await old.close()
