"""The ``mooncake`` tier: one object per block in a Mooncake Store pool, the DRAM every
engine of the fleet contributes (`segment_bytes` each), placed and evicted by the pool's
master, moved by Mooncake's transfer engine (TCP, or RDMA where a deployment has it).

Objects are named ``<key_prefix>:<namespace hex>:<block key hex>``: engines of another
identity or weights never meet, engines of the same share. An object is the stored format of
`tiering.tiers.object_format` (header + payload), written with upsert (a put replaces), and
checked (header, length and XXH3-64 or seal) as it arrives in the staging memory, before its
copy into the row: a stale, foreign or torn object is a miss, never loaded.

A block whose object lands in this engine's own segment (`segment_bytes`, placed there by
`prefer_local_segment` where it has room) is announced `LOCAL` in the tier's KV events, the
others `REMOTE` (`local_keys`: one replica query per stored batch, only while events are kept).

The master owns eviction (its high watermark): an absent object is a miss, and the tier sets
no capacity of its own. Tiers probe keys they have not seen (one ``batch_is_exist`` per
step's probes), since other engines put the same keys; the index starts empty unless
`recover_index` lists the pool's keys through the master's HTTP admin server
(`admin_address`). The identity's records are hard-pinned: the master never evicts them.

Loop thread: every coroutine of `MooncakeBlockStore`; the blocking work runs on the client's
threads (`tiering.backends.mooncake.client`).
"""

from __future__ import annotations

import errno
import re
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
from pydantic import BaseModel

from tiering.backends.mooncake.client import MooncakeClient, MooncakeOptions, ReplicateConfig
from tiering.contract.keys import OffloadKey
from tiering.contract.mediums import REMOTE
from tiering.errors import CorruptObjectError, ObjectNotFoundError
from tiering.tiers.blockstore import BlockStore, BlockStoreSettings
from tiering.tiers.object_format import (
    MAX_KEY_BYTES,
    ObjectHeader,
    check_length,
    encode_object,
    object_size,
    parse_header,
    verify_payload,
)

OBJECT_NOT_FOUND = -704  # Mooncake's ErrorCode values, as its Python calls return them
NO_AVAILABLE_HANDLE = -200  # no room in the pool
SIZE_MISMATCH = (-600, -800)  # a get's buffer is larger or smaller than the object


def status_error(status: int, what: str) -> Exception:
    """The exception of a negative Mooncake status for `what` (a key's name, or a call)."""
    if status == OBJECT_NOT_FOUND:
        return ObjectNotFoundError(what)
    if status == NO_AVAILABLE_HANDLE:
        return OSError(errno.ENOSPC, f"{what}: no room in the Mooncake pool")
    return OSError(errno.EIO, f"{what}: Mooncake status {status}")


def slice_fulls(sizes: Sequence[int], capacity: int, outcomes: list[Any]) -> Iterator[list[tuple[int, int]]]:
    """The items of `sizes` (bytes of each object) cut into runs that fit a staging slice of
    `capacity` bytes, in order: each run a list of (item, offset in the slice). An item larger
    than the slice is in none: its outcome becomes an EFBIG error."""
    run: list[tuple[int, int]] = []
    used = 0
    for i, size in enumerate(sizes):
        if size > capacity:
            outcomes[i] = OSError(errno.EFBIG, f"an object of {size} bytes is over a staging slice of {capacity}")
            continue
        if used + size > capacity:
            yield run
            run, used = [], 0
        run.append((i, used))
        used += size
    if run:
        yield run


class MooncakeBlockStore(BlockStore):
    """Blocks as objects in a Mooncake Store pool. Tier type ``mooncake``: its tiers probe
    keys they have not seen and send about `batch_bytes` (16 MiB) of blocks per call, at most
    `max_concurrency` (4) calls at once, each within `op_timeout_s` (10 s): a call costs the
    master a placement RPC and a commit, so a few large calls move 2-3x the bytes of many
    small ones (0.54 against 0.24 GB/s of 2 MiB stores here, `tiering.benchmarks.mooncake_tier`).

    Args:
        fingerprint: the namespace; it is part of every object's name.
        master_address: ``host:port`` of the master's RPC.
        metadata_server: the transfer engine's metadata service (the master's built-in HTTP
            one: ``http://host:port/metadata``; ``P2PHANDSHAKE``; an etcd address).
        local_hostname: the address other engines reach this one's segment at.
        protocol: ``tcp``, or ``rdma`` (with `rdma_devices`).
        segment_bytes: memory this engine contributes to the pool (0: none, a client only).
        local_buffer_bytes: the Mooncake client's own transfer buffer.
        staging_bytes: registered memory blocks pass through, split between the threads.
        threads: threads the blocking calls run on (each call takes one).
        key_prefix: first part of every object's name.
        replicas: copies of each block the master places.
        prefer_local_segment: place a block in this engine's own segment where it has room.
        network_namespace: a network namespace the client lives in (see the client module).
        admin_address: ``host:port`` of the master's HTTP admin server, for listings.
        recover_index: list the namespace when the tier opens (needs `admin_address`).
    """

    Options = MooncakeOptions
    tier_defaults: ClassVar[dict[str, Any]] = {  # few, large calls: each costs the master two RPCs
        "max_concurrency": 4,
        "op_timeout_s": 10.0,
        "batch_bytes": 16 << 20,
        "probe_misses": True,
        "index_max_blocks": 1 << 20,
    }
    evicts_itself = True
    verifies_payloads = True  # each object is checked in the staging memory, before its copy into the row
    supports_integrity = True
    locality = REMOTE

    @classmethod
    def from_config(cls, fingerprint: bytes, options: BaseModel, settings: BlockStoreSettings) -> MooncakeBlockStore:
        assert isinstance(options, MooncakeOptions)
        return cls(fingerprint, options)

    @classmethod
    def check_config(cls, options: BaseModel, settings: BlockStoreSettings) -> None:
        """The master owns eviction; listing needs the admin server.

        Raises:
            ValueError: `capacity_bytes` is set, or `recover_index` without `admin_address`.
        """
        assert isinstance(options, MooncakeOptions)
        if settings.capacity_bytes is not None:
            raise ValueError("capacity_bytes is not taken: the master evicts (its eviction_high_watermark_ratio)")
        if options.recover_index and options.admin_address is None:
            raise ValueError("recover_index needs admin_address (the master's HTTP admin server lists the keys)")

    @classmethod
    def location(cls, options: Mapping[str, Any]) -> str:
        """``mooncake``, the master and the key prefix."""
        prefix = options.get("key_prefix", MooncakeOptions.model_fields["key_prefix"].default)
        return f"mooncake {options['master_address']} {prefix}"

    def __init__(self, fingerprint: bytes, options: MooncakeOptions):
        super().__init__(fingerprint)
        self.options = options
        self._prefix = f"{options.key_prefix}:{fingerprint.hex()}:"
        self._client: MooncakeClient | None = None
        self._put_config = ReplicateConfig()
        self._put_config.replica_num = options.replicas

    def __repr__(self) -> str:
        return f"MooncakeBlockStore(master {self.options.master_address}, key_prefix={self.options.key_prefix!r})"

    def for_records(self) -> MooncakeBlockStore:
        """Itself, its objects hard-pinned (an identity's records and the engines' leases are
        labels the master's eviction would only lose, and few), and its client small: one
        thread, 4 MiB of staging, no memory lent to the pool (the engine's block store lends
        its `segment_bytes` once, not once per client). Before `open`."""
        self._put_config.with_hard_pin = True
        self.options = self.options.model_copy(update={"segment_bytes": 0, "threads": 1, "staging_bytes": 4 << 20})
        return self

    def object_name(self, key: OffloadKey) -> str:
        """The pool's name of `key`'s object: ``<key_prefix>:<namespace hex>:<key hex>``."""
        return self._prefix + key.hex()

    async def open(self) -> None:
        """Set up the client (its segment joins the pool).

        Raises:
            OSError: Mooncake's setup failed, or the network namespace cannot be entered.
        """
        largest = 0 if self.block_bytes is None else object_size(MAX_KEY_BYTES, self.block_bytes)
        client = MooncakeClient(self.options, largest)
        await client.open()
        self.places_locally = bool(self.options.segment_bytes and client.hostname)
        if self.options.prefer_local_segment and self.places_locally:
            self._put_config.preferred_segment = client.hostname
        self._client = client
        await super().open()

    async def close(self) -> None:
        await super().close()
        client, self._client = self._client, None
        if client is not None:
            await client.close()

    def _live(self) -> MooncakeClient:
        self.check_open()
        assert self._client is not None
        return self._client

    async def put(self, key: OffloadKey, payload: memoryview) -> None:
        outcome = (await self.put_many([(key, payload)]))[0]
        if outcome is not None:
            raise outcome

    async def put_many(self, items: Sequence[tuple[OffloadKey, memoryview]]) -> list[Exception | None]:
        """The objects written into this thread's staging slice and upserted in one batch per
        slice-full."""
        client = self._live()
        return await client.call(self._put_batch, client, items)

    def _put_batch(
        self, client: MooncakeClient, items: Sequence[tuple[OffloadKey, memoryview]]
    ) -> list[Exception | None]:
        slot, base = client.slot()
        outcomes: list[Exception | None] = [None] * len(items)
        sizes = [object_size(len(key), payload.nbytes) for key, payload in items]
        for run in slice_fulls(sizes, slot.nbytes, outcomes):
            sent = []
            for i, offset in run:
                key, payload = items[i]
                try:
                    parts = encode_object(key, payload, self.fingerprint, seal=self.seal)
                except ValueError as exc:
                    outcomes[i] = exc
                    continue
                at = offset
                for part in parts:
                    view = np.frombuffer(part, np.uint8)
                    slot[at : at + view.nbytes] = view
                    at += view.nbytes
                sent.append((i, self.object_name(key), base + offset))
            if sent:
                names = [name for _, name, _ in sent]
                addresses, lengths = [address for _, _, address in sent], [sizes[i] for i, _, _ in sent]
                statuses = client.store.batch_upsert_from(names, addresses, lengths, self._put_config)
                for (i, name, _), status in zip(sent, statuses, strict=True):
                    if status != 0:
                        outcomes[i] = status_error(status, name)
        return outcomes

    async def get(self, key: OffloadKey, into: memoryview) -> ObjectHeader:
        outcome = (await self.get_many([(key, into)]))[0]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    async def get_many(self, items: Sequence[tuple[OffloadKey, memoryview]]) -> list[ObjectHeader | Exception]:
        """The objects read into this thread's staging slice one batch per slice-full, each
        checked there and copied into its row."""
        client = self._live()
        return await client.call(self._get_batch, client, items)

    def _get_batch(
        self, client: MooncakeClient, items: Sequence[tuple[OffloadKey, memoryview]]
    ) -> list[ObjectHeader | Exception]:
        slot, base = client.slot()
        outcomes: list[ObjectHeader | Exception] = [ObjectNotFoundError("not read")] * len(items)
        sizes = [object_size(len(key), into.nbytes) for key, into in items]
        for run in slice_fulls(sizes, slot.nbytes, outcomes):
            names = [self.object_name(items[i][0]) for i, _ in run]
            addresses, lengths = [base + offset for _, offset in run], [sizes[i] for i, _ in run]
            statuses = client.store.batch_get_into(names, addresses, lengths)
            for (i, offset), name, status in zip(run, names, statuses, strict=True):
                outcomes[i] = self._unpack(items[i], name, slot[offset : offset + sizes[i]], status)
        return outcomes

    def _unpack(
        self, item: tuple[OffloadKey, memoryview], name: str, raw: np.ndarray, status: int
    ) -> ObjectHeader | Exception:
        """Check what `batch_get_into` read for `item` (`status`: bytes read, or an error) and
        copy its payload into the item's row; the outcome, an error included."""
        key, into = item
        try:
            if status in SIZE_MISMATCH or 0 <= status != raw.nbytes:
                raise CorruptObjectError(f"{name}: an object of another length ({status})")
            if status < 0:
                raise status_error(status, name)
            data = raw.data
            header = parse_header(data, self.fingerprint, key, self.seal)
            payload = data[header.size :]
            target = into.cast("B")
            check_length(header, payload.nbytes, target.nbytes)
            verify_payload(header, payload, self.seal)
            target[:] = payload
            return header
        except Exception as exc:
            return exc

    async def exists(self, key: OffloadKey) -> bool:
        answer = (await self.exists_many([key]))[0]
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def exists_many(self, keys: Sequence[OffloadKey]) -> list[bool | Exception]:
        """One ``batch_is_exist``."""
        client = self._live()
        names = [self.object_name(key) for key in keys]
        answers = await client.call(lambda: client.store.batch_is_exist(names))
        pairs = zip(names, answers, strict=True)
        return [answer == 1 if answer >= 0 else status_error(answer, name) for name, answer in pairs]

    async def local_keys(self, keys: Sequence[OffloadKey]) -> set[OffloadKey]:
        """One ``batch_get_replica_desc``: the keys with a replica in this engine's own
        segment (an object not found is in none)."""
        client = self._live()
        names = {self.object_name(key): key for key in keys}
        replicas = await client.call(lambda: client.store.batch_get_replica_desc(list(names)))
        here = client.hostname
        return {
            names[name]
            for name, found in replicas.items()
            if any(
                r.is_memory_replica() and r.get_memory_descriptor().buffer_descriptor.transport_endpoint == here
                for r in found
            )
        }

    async def delete_many(self, keys: Collection[OffloadKey]) -> None:
        """One forced ``batch_remove`` (an object read within the master's lease is removed
        too); missing objects are ignored.

        Raises:
            OSError: an object could not be removed.
        """
        client = self._live()
        names = [self.object_name(key) for key in keys]
        if not names:
            return
        statuses = await client.call(lambda: client.store.batch_remove(names, True))
        for name, status in zip(names, statuses, strict=True):
            if status < 0 and status != OBJECT_NOT_FOUND:
                raise status_error(status, name)

    async def ping(self) -> None:
        """The client's health check (the master answers).

        Raises:
            ConnectionError: it does not.
        """
        client = self._live()
        status = await client.call(lambda: client.store.health_check())
        if status != 0:
            raise ConnectionError(f"Mooncake health check: status {status} (2: the master is unreachable)")

    async def recover(self) -> list[tuple[OffloadKey, int]]:
        """With `recover_index`: the namespace's objects, listed by the master's admin server,
        with their sizes (objects that vanish meanwhile are left out). Without it: none."""
        client = self._live()
        if not self.options.recover_index:
            return []
        return await client.call(self._list, client)

    def _list(self, client: MooncakeClient) -> list[tuple[OffloadKey, int]]:
        found = []
        for line in client.admin_get("/get_all_keys").decode().splitlines():
            if not line.startswith(self._prefix):
                continue
            try:
                key = OffloadKey(bytes.fromhex(line[len(self._prefix) :]))
            except ValueError:
                continue  # not one of ours
            size = client.store.get_size(line)
            if size > 0:
                found.append((key, size))
        return found

    async def remove_namespace(self) -> None:
        """Remove every object of the namespace (one forced ``remove_by_regex``).

        Raises:
            OSError: the master refused.
        """
        client = self._live()
        pattern = "^" + re.escape(self._prefix)
        status = await client.call(lambda: client.store.remove_by_regex(pattern, True))
        if status < 0:
            raise status_error(status, f"remove_by_regex {pattern}")
