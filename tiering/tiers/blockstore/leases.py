"""Leases: the namespaces of an identity that running engines use, so that nothing removes them.

Every engine with a lasting tier keeps one lease in its identity's lease namespace
(`lease_namespace`): the object ``~lease-<engine>``, JSON that names the namespaces of blocks
the engine uses (the weights in force and, until their last jobs end, those before a reset),
its host and process, and when it was last renewed (the writer's clock, Unix seconds). The
engine renews it every `RENEW_S` seconds on the tier's loop and deletes it when it stops; a
lease not renewed for `LEASE_S` seconds (an engine killed, a machine lost) is no longer live.
``tiering-config prune`` never removes a namespace that a live lease names
(`tiering.tiers.blockstore.namespaces`); clocks of the engines and of the machine that runs
prune must agree within `LEASE_S` less `RENEW_S`.

A lease is a label, as the records are: one that cannot be written (a full disk, a frozen
server) is logged and tried again at the next renewal, never a reason for a tier not to open
or to stop. Its only cost while it is missing: a prune could remove a namespace the engine
uses, which the engine sees as misses, never wrong bytes.

Loop thread: the coroutines (the tier runs them on its event loop).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import anyio

from tiering.contract.identity import MAX_WEIGHT_VERSION_CHARS, NAMESPACE_BYTES
from tiering.contract.keys import OffloadKey
from tiering.errors import CorruptObjectError, ObjectNotFoundError, describe
from tiering.tiers.blockstore.store import BlockStore
from tiering.tiers.object_format import open_payload

logger = logging.getLogger(__name__)

RENEW_S = 60.0  # seconds between two renewals of an engine's lease
LEASE_S = 900.0  # a lease not renewed for this many seconds is no longer live
CALL_TIMEOUT_S = 30.0  # seconds one write of a lease may take
CLOSE_TIMEOUT_S = 2.0  # seconds its delete may take when the engine stops (else it expires)
LEASE_PREFIX = b"~lease-"
MAX_HELD = 4  # namespaces one lease names at most (the weights in force, and those retiring)
MAX_HOST_CHARS = 64  # of the host name a lease records (the record has one size)
LEASE_BYTES = 512 + MAX_HELD * (2 * NAMESPACE_BYTES + 2 * MAX_WEIGHT_VERSION_CHARS + 64)


def lease_namespace(identity_digest: bytes) -> bytes:
    """16 bytes naming the namespace of an identity's leases."""
    return hashlib.blake2b(identity_digest, digest_size=NAMESPACE_BYTES, person=b"kv-leases").digest()


@dataclass(frozen=True)
class LeaseRecord:
    """One engine's lease as read back: `engine` (a random name per start), `host`, `pid`,
    `held` (hex namespace to the weights it holds, in words), `renewed` (Unix seconds, the
    engine's clock)."""

    key: OffloadKey
    engine: str
    host: str
    pid: int
    held: dict[str, str]
    renewed: float

    def live(self, now: float) -> bool:
        """Whether the lease was renewed within `LEASE_S` seconds of `now` (Unix seconds). One
        dated more than `LEASE_S` ahead of `now` is not (a clock far off, or a record written
        to keep namespaces from prune for good), nor one whose time is not a number."""
        return -LEASE_S < now - self.renewed < LEASE_S

    def describe(self, now: float) -> str:
        """The engine in a few words: ``engine 3f2a... on host pid 123, renewed 12 s ago``."""
        return f"engine {self.engine} on {self.host} pid {self.pid}, renewed {max(0, round(now - self.renewed))} s ago"


class Lease:
    """This engine's lease in one tier (`open` to `close`), naming the namespaces `hold` adds
    and `release` takes back.

    Args:
        store: an unopened store of the identity's lease namespace (a store of records).
        clock: Unix seconds (tests pass their own).
    """

    def __init__(self, store: BlockStore, clock: Callable[[], float] = time.time):
        self.engine = secrets.token_hex(8)
        self.key = OffloadKey(LEASE_PREFIX + self.engine.encode())
        self._store = store
        self._clock = clock
        self._held: dict[bytes, tuple[str, int]] = {}  # namespace: (weights in words, holds not released)
        self._opened = False
        self._failing = False  # the last write failed (logged once until one succeeds)
        self._renewal: asyncio.Task[None] | None = None

    async def open(self, namespace: bytes, weights: str) -> None:
        """Write the lease on `namespace` (`weights`: in words) and renew it every `RENEW_S`
        seconds until `close`. Never raises: a failure is logged, and tried again."""
        self._held = {namespace: (weights, 1)}
        await self._write()
        self._renewal = asyncio.get_running_loop().create_task(self._renew())

    async def hold(self, namespace: bytes, weights: str) -> None:
        """Add `namespace` to the lease (before the engine opens it), written at once; each
        hold is taken back by one `release`."""
        _, holds = self._held.pop(namespace, ("", 0))
        self._held[namespace] = (weights, holds + 1)  # the latest last: a lease names the latest `MAX_HELD`
        await self._write()

    async def release(self, namespace: bytes) -> None:
        """Take back one `hold` of `namespace` (once the engine's last call in it ended): it
        leaves the lease with the last."""
        weights, holds = self._held.get(namespace, ("", 0))
        if holds > 1:
            self._held[namespace] = (weights, holds - 1)
        elif self._held.pop(namespace, None) is not None:
            await self._write()

    async def close(self) -> None:
        """Stop renewing and delete the lease (within `CLOSE_TIMEOUT_S`: else it expires),
        then remove what opening the lease namespace created where it holds nothing else
        (`BlockStore.undo_open`: the first engine of an identity leaves no empty namespace).
        Never raises."""
        if self._renewal is not None:
            self._renewal.cancel()
            self._renewal = None
        if not self._opened:
            return
        self._opened = False
        try:
            with anyio.fail_after(CLOSE_TIMEOUT_S):
                await self._store.delete_many([self.key])
                await self._store.undo_open()
        except Exception as exc:
            logger.info(
                "%r: lease %s not deleted (%s): it expires in %.0f s", self._store, self.engine, describe(exc), LEASE_S
            )
            with anyio.CancelScope(shield=True):
                await self._store.close()

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(RENEW_S)
            await self._write()

    async def _write(self) -> None:
        """Write the lease as it stands (opening its store first where it is not open yet),
        within `CALL_TIMEOUT_S`; a failure is logged once until a write succeeds."""
        record = {
            "engine": self.engine,
            "host": socket.gethostname()[:MAX_HOST_CHARS],
            "pid": os.getpid(),
            "held": {namespace.hex(): weights for namespace, (weights, _) in list(self._held.items())[-MAX_HELD:]},
            "renewed": self._clock(),
        }
        try:
            with anyio.fail_after(CALL_TIMEOUT_S):
                if not self._opened:
                    await self._store.open()
                    self._opened = True
                await self._store.put(self.key, memoryview(json.dumps(record).encode().ljust(LEASE_BYTES)))
        except Exception as exc:
            if not self._failing:
                logger.warning(
                    "%r: this engine's lease was not written (%s): tried again in %.0f s; meanwhile a prune may "
                    "remove the namespaces it uses (misses, never wrong bytes)",
                    self._store,
                    describe(exc),
                    RENEW_S,
                )
            self._failing = True
        else:
            if self._failing:
                logger.info("%r: this engine's lease is written again", self._store)
            self._failing = False


async def read_leases(store: BlockStore) -> list[LeaseRecord]:
    """The leases an opened store of a lease namespace holds (`BlockStore.recover` lists
    them); one that does not open or parse is left out (a torn write, a stranger's).

    Raises:
        Exception: the store's own errors (it cannot be listed).
    """
    found = []
    into = bytearray(LEASE_BYTES)
    for key, _ in await store.recover():
        if not bytes(key).startswith(LEASE_PREFIX):
            continue
        try:
            header = await store.get(key, memoryview(into))
            open_payload(header, memoryview(into), store.seal)
            record = json.loads(into)
            held = record["held"]
            if not isinstance(held, dict):
                raise ValueError("held is not an object")
            found.append(
                LeaseRecord(
                    key,
                    str(record["engine"]),
                    str(record["host"]),
                    int(record["pid"]),
                    {str(k): str(v) for k, v in held.items()},
                    float(record["renewed"]),
                )
            )
        except (ObjectNotFoundError, CorruptObjectError, ValueError, KeyError, TypeError):
            continue  # deleted meanwhile, torn, or not a lease of ours
    return found
