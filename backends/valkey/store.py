"""The ``valkey`` tier (alias ``redis``): one value per block on a Valkey or Redis server or
cluster, through valkey-glide, shared by every engine of the same layout.

Keys are ``<key_prefix>:<layout fingerprint hex>:<block key hex>``: engines of different
models or layouts never collide, engines of the same layout share. Values are the stored
format of `tiering.tiers.object_format` (header + payload; the XXH3-64 is checked as each value
arrives, before its copy into the row), so a stale, foreign or torn value is a miss, never
loaded. Keys of different blocks hash to different slots; there is no multi-key command:
a store call sends its blocks (`batch_bytes` worth) as one non-atomic pipeline of SETs or
GETs, which glide splits by node, at most the tier's `max_concurrency` calls at once.

The server owns eviction: run it with ``maxmemory`` and an LRU policy; an absent key is a
miss. The tier sets no capacity of its own (``capacity_bytes`` is refused: one owner of
eviction); an optional ``ttl_s`` stores each value with an expiry, refreshed by every load
(GETEX). Tiers probe keys they have not seen (a step's probes as one pipeline of EXISTS, a
short negative cache), since other engines write the same keys; the index starts empty
unless `recover_index`.

Loop thread: every coroutine of `ValkeyBlockStore`; `ValkeyOptions` and the class methods run
where the config is loaded. One glide client per tier, created and closed on the runtime's
loop; glide's core keeps one connection per node, follows slot moves and reconnects.
Connecting, the config keys and the password are `tiering.backends.valkey.client`'s.
"""

from __future__ import annotations

import errno
from collections.abc import Collection, Mapping, Sequence
from typing import Any, ClassVar

import anyio
from pydantic import BaseModel

from tiering.backends.valkey.client import (
    Batch,
    ClusterBatch,
    ClusterScanCursor,
    ExpiryGetEx,
    ExpirySet,
    ExpiryType,
    ExpiryTypeGetEx,
    RequestError,
    ValkeyConnection,
    ValkeyOptions,
    parse_address,
    read_password,
)
from tiering.contract.keys import OffloadKey
from tiering.contract.mediums import REMOTE
from tiering.errors import CorruptObjectError, ObjectNotFoundError, UnusableObjectError, describe
from tiering.tiers.blockstore import BlockStore, BlockStoreSettings
from tiering.tiers.blockstore.store import RecoveryProgress
from tiering.tiers.object_format import (
    ObjectHeader,
    check_length,
    encode_object,
    object_size,
    parse_header,
    verify_payload,
)

_DELETE_BATCH = 512  # keys per DEL (glide splits a cluster's batch by slot)
_SCAN_COUNT = 1000  # keys per SCAN step when recovering
_SIZE_CONCURRENCY = 64  # STRLEN requests in flight when recovering
EVICTS_WITHOUT_EXPIRY = ("allkeys-lru", "allkeys-lfu", "allkeys-random")  # maxmemory-policy values


def _per_key(exc: Exception) -> Exception:
    """`exc` as an `UnusableObjectError` when it is about one key only (another program put
    a list or hash at a block's name: ``WRONGTYPE``), else as it is (the server's failure)."""
    if str(exc).startswith("WRONGTYPE"):
        return UnusableObjectError(str(exc))
    return exc


class ValkeyBlockStore(BlockStore):
    """Blocks as values on a Valkey/Redis server (standalone) or cluster. Tier type
    ``valkey`` (alias ``redis``): its tiers probe keys they have not seen and send a
    pipeline of about `batch_bytes` (1 MiB) of blocks per call, at most `max_concurrency`
    (64) calls at once, each within `op_timeout_s` (10 s).

    Args:
        fingerprint: the layout fingerprint; it is part of every key.
        addresses: ``host:port`` of the server, or of some nodes of the cluster (glide finds
            the others).
        cluster_mode: the servers are a cluster.
        key_prefix: first part of every key (no ``{}``: no hash tags).
        tls: connect with TLS, verifying the server's certificate.
        tls_ca_file: PEM file of the CAs to trust instead of the system's.
        username: ACL user, or None for ``default``.
        password: the password, or None to connect without one.
        connect_timeout_s: seconds to open a connection.
        request_timeout_s: seconds one request may take, retries and reconnects included.
        ttl_s: expiry of every value, refreshed when it is loaded; None: none (the server's
            ``maxmemory`` policy evicts).
        max_value_bytes: a value larger than this is refused before it is sent (the
            server's ``proto-max-bulk-len``, 512 MiB by default).
        recover_index: list the namespace when the tier opens (a SCAN of every primary and
            a STRLEN per value: about 10 s per 100,000 values on a 2-core machine), so that
            lookups of blocks stored before hit at once. Off by default: a shared cluster
            may hold millions of values, the listing goes stale as the server evicts, and
            probes find each block the first time a lookup asks for it (one round trip per
            request).
        max_inflight: requests glide lets be in flight at once (both lanes of the tier).
    """

    Options = ValkeyOptions
    tier_defaults: ClassVar[dict[str, Any]] = {
        "max_concurrency": 64,
        "op_timeout_s": 10.0,
        "batch_bytes": 1 << 20,  # a call sends its blocks as one pipeline: 16 of 64 KiB, 1 of 2 MiB
        "probe_misses": True,
        "index_max_blocks": 1 << 20,  # ~200 MiB of index; the server may hold far more
    }
    evicts_itself = True
    verifies_payloads = True  # each value is checked as it arrives, before the copy into its row
    supports_integrity = True
    locality = REMOTE

    @classmethod
    def from_config(cls, fingerprint: bytes, options: BaseModel, settings: BlockStoreSettings) -> ValkeyBlockStore:
        """A store of the tier's config, its password read from `password_env` or
        `password_file`.

        Raises:
            ValueError: the variable is not set, or the file cannot be read (the message
                names the variable or the file, never the password).
        """
        assert isinstance(options, ValkeyOptions)
        values = options.model_dump(exclude={"password_env", "password_file"})
        return cls(fingerprint, **values, password=read_password(options), max_inflight=4 * settings.max_concurrency)

    @classmethod
    def check_config(cls, options: BaseModel, settings: BlockStoreSettings) -> None:
        """The server owns eviction, and client timeouts are below the operation timeout (so
        a frozen node fails requests, and trips the breaker, within seconds).

        Raises:
            ValueError: `capacity_bytes` is set, or a client timeout is not below
                `op_timeout_s`.
        """
        assert isinstance(options, ValkeyOptions)
        if settings.capacity_bytes is not None:
            raise ValueError(
                "capacity_bytes is not taken: the server evicts (set its maxmemory and an LRU maxmemory-policy)"
            )
        settings.check_client_timeouts(
            connect_timeout_s=options.connect_timeout_s, request_timeout_s=options.request_timeout_s
        )

    @classmethod
    def location(cls, options: Mapping[str, Any]) -> str:
        """``valkey``, the addresses (any order) and the key prefix."""
        prefix = options.get("key_prefix", ValkeyOptions.model_fields["key_prefix"].default)
        return f"valkey {sorted(options['addresses'])} {prefix}"

    def __init__(
        self,
        fingerprint: bytes,
        addresses: list[str],
        cluster_mode: bool = False,
        key_prefix: str = "kvt",
        tls: bool = False,
        tls_ca_file: str | None = None,
        username: str | None = None,
        password: str | None = None,
        connect_timeout_s: float = 2.0,
        request_timeout_s: float = 5.0,
        ttl_s: float | None = None,
        max_value_bytes: int = 512 << 20,
        recover_index: bool = False,
        max_inflight: int = 1000,
    ):
        super().__init__(fingerprint)
        self._connection = ValkeyConnection(
            [parse_address(address) for address in addresses],
            cluster_mode,
            tls,
            tls_ca_file,
            username,
            password,
            connect_timeout_s,
            request_timeout_s,
            max_inflight,
        )
        self.cluster_mode = cluster_mode
        self.key_prefix = key_prefix
        self.ttl_s = ttl_s
        self.max_value_bytes = max_value_bytes
        self.recover_index = recover_index
        self._namespace = f"{key_prefix}:{fingerprint.hex()}:".encode()
        ttl_ms = None if ttl_s is None else max(1, round(ttl_s * 1000))
        self._set_expiry = None if ttl_ms is None else ExpirySet(ExpiryType.MILLSEC, ttl_ms)
        self._getex_expiry = None if ttl_ms is None else ExpiryGetEx(ExpiryTypeGetEx.MILLSEC, ttl_ms)
        self._client: Any = None

    def __repr__(self) -> str:
        return f"ValkeyBlockStore({self._connection!r}, key_prefix={self.key_prefix!r})"

    def for_records(self) -> ValkeyBlockStore:
        """Itself, its values stored without an expiry whatever ``ttl_s`` says: an identity's
        records (`tiering.tiers.blockstore.generations`) are labels that a TTL would only
        lose, while every block keeps its expiry."""
        self.ttl_s = None
        self._set_expiry = self._getex_expiry = None
        return self

    def value_name(self, key: OffloadKey) -> bytes:
        """The server's key of the value of `key`: ``<key_prefix>:<fingerprint hex>:<key hex>``,
        ASCII bytes. Pure; any thread."""
        return self._namespace + key.hex().encode()

    async def open(self) -> None:
        """Connect (to every node, in cluster mode) and check that the mode matches.

        Raises:
            PermissionError: the server refused the credentials.
            ConnectionError: no server answered in time.
            OSError: the server is a cluster node and `cluster_mode` is off, or the reverse.
        """
        self._client = await self._connection.connect()
        await super().open()

    async def _close_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.close()

    async def close(self) -> None:
        await super().close()
        await self._close_client()

    async def put(self, key: OffloadKey, payload: memoryview) -> None:
        self.check_open()
        value = self._value(key, payload)
        try:
            await self._client.set(self.value_name(key), value, expiry=self._set_expiry)
        except RequestError as exc:
            raise self._store_error(exc) from exc

    async def put_many(self, items: Sequence[tuple[OffloadKey, memoryview]]) -> list[Exception | None]:
        """One pipeline of SETs (not atomic: glide sends each to the node of its slot).

        Raises:
            Exception: the pipeline as a whole failed (every item failed with it).
        """
        self.check_open()
        if len(items) == 1:
            return await super().put_many(items)
        outcomes: list[Exception | None] = [None] * len(items)
        batch, sent = self._pipeline(), []
        for i, (key, payload) in enumerate(items):
            try:
                value = self._value(key, payload)
            except OSError as exc:
                outcomes[i] = exc
                continue
            batch.set(self.value_name(key), value, expiry=self._set_expiry)
            sent.append(i)
        if sent:
            for i, result in zip(sent, await self._client.exec(batch, raise_on_error=False), strict=True):
                if isinstance(result, RequestError):
                    outcomes[i] = self._store_error(result)
        return outcomes

    def _value(self, key: OffloadKey, payload: memoryview) -> bytes:
        """The stored value of a block: header and payload, joined.

        Raises:
            OSError: EFBIG, over `max_value_bytes`.
        """
        size = object_size(len(key), payload.nbytes)
        if size > self.max_value_bytes:
            raise OSError(errno.EFBIG, f"a value of {size} bytes is over max_value_bytes ({self.max_value_bytes})")
        return b"".join(encode_object(key, payload, self.fingerprint, seal=self.seal))

    def _store_error(self, exc: RequestError) -> Exception:
        """A SET's error: a full server (maxmemory reached, noeviction) is ENOSPC."""
        if str(exc).lstrip().startswith("OOM"):  # "OOM command not allowed ...", or "OOM: ..." in a pipeline
            return OSError(errno.ENOSPC, f"{self._connection.where()}: out of memory (maxmemory reached, noeviction)")
        return exc

    async def get(self, key: OffloadKey, into: memoryview) -> ObjectHeader:
        self.check_open()
        name = self.value_name(key)
        try:
            if self._getex_expiry is None:
                value = await self._client.get(name)
            else:
                value = await self._client.getex(name, self._getex_expiry)
        except Exception as exc:
            raise _per_key(exc) from None
        return self._unpack(key, value, into)

    async def get_many(self, items: Sequence[tuple[OffloadKey, memoryview]]) -> list[ObjectHeader | Exception]:
        """One pipeline of GETs (GETEX with `ttl_s`), each value checked and copied out.

        Raises:
            Exception: the pipeline as a whole failed (every item failed with it).
        """
        self.check_open()
        if len(items) == 1:
            return await super().get_many(items)
        batch = self._pipeline()
        for key, _ in items:
            if self._getex_expiry is None:
                batch.get(self.value_name(key))
            else:
                batch.getex(self.value_name(key), self._getex_expiry)
        outcomes: list[ObjectHeader | Exception] = []
        for (key, into), value in zip(items, await self._client.exec(batch, raise_on_error=False), strict=True):
            try:
                if isinstance(value, Exception):
                    raise _per_key(value)
                outcomes.append(self._unpack(key, value, into))
            except Exception as exc:
                outcomes.append(exc)
        return outcomes

    def _pipeline(self) -> Batch | ClusterBatch:
        return ClusterBatch(is_atomic=False) if self.cluster_mode else Batch(is_atomic=False)

    def _unpack(self, key: OffloadKey, value: Any, into: memoryview) -> ObjectHeader:
        """Check the value GET returned for `key` and copy its payload into `into`.

        Raises:
            ObjectNotFoundError: no value (`value` is None).
            CorruptObjectError: not a string, or its header or length is wrong.
        """
        if value is None:
            raise ObjectNotFoundError(key)
        if not isinstance(value, bytes):
            raise CorruptObjectError(f"value of type {type(value).__name__}, not a string")
        into = into.cast("B")
        header = parse_header(value, self.fingerprint, key, self.seal)
        payload = memoryview(value)[header.size :]
        check_length(header, payload.nbytes, into.nbytes)
        verify_payload(header, payload, self.seal)
        into[:] = payload
        return header

    async def exists(self, key: OffloadKey) -> bool:
        self.check_open()
        return bool(await self._client.exists([self.value_name(key)]))

    async def exists_many(self, keys: Sequence[OffloadKey]) -> list[bool | Exception]:
        """One pipeline of single-key EXISTS (a multi-key EXISTS counts, it does not say which).

        Raises:
            Exception: the pipeline as a whole failed.
        """
        self.check_open()
        batch = self._pipeline()
        for key in keys:
            batch.exists([self.value_name(key)])
        answers = await self._client.exec(batch, raise_on_error=False)
        return [answer if isinstance(answer, Exception) else bool(answer) for answer in answers]

    async def delete_many(self, keys: Collection[OffloadKey]) -> None:
        self.check_open()
        names = [self.value_name(key) for key in keys]
        for start in range(0, len(names), _DELETE_BATCH):
            await self._client.delete(names[start : start + _DELETE_BATCH])

    async def recover(self) -> list[tuple[OffloadKey, int]]:
        """With `recover_index`: the values under the namespace with their sizes, in the
        server's scan order (the server tracks recency, not the tier); values that vanish
        during the scan (expired, evicted) are left out, and values are verified when loaded,
        not here. Without it: none (blocks are found by probes as lookups ask for them)."""
        self.check_open()
        if not self.recover_index:
            return []
        return await self._list()

    async def remove_namespace(self) -> None:
        """Delete every value of the namespace (a SCAN of every primary, then DELs)."""
        self.check_open()
        await self.delete_many([key for key, _ in await self._list()])

    async def _list(self) -> list[tuple[OffloadKey, int]]:
        progress = RecoveryProgress(f"valkey tier {self._namespace.decode()}*")
        names = await self._scan(progress)
        sizes = [0] * len(names)
        limit = anyio.Semaphore(_SIZE_CONCURRENCY)

        async def size_of(i: int) -> None:
            async with limit:
                sizes[i] = await self._client.strlen(names[i])

        async with anyio.create_task_group() as task_group:
            for i in range(len(names)):
                task_group.start_soon(size_of, i)
        found = []
        for name, size in zip(names, sizes, strict=True):
            try:
                key = OffloadKey(bytes.fromhex(name[len(self._namespace) :].decode()))
            except ValueError:
                continue  # not one of ours
            if size:
                found.append((key, size))
        return found

    async def _scan(self, progress: RecoveryProgress) -> list[bytes]:
        """Every key of the namespace (cluster: of every primary), each once."""
        pattern = self._namespace + b"*"
        names: dict[bytes, None] = {}
        if self.cluster_mode:
            cursor = ClusterScanCursor()
            while not cursor.is_finished():
                cursor, batch = await self._client.scan(cursor, match=pattern, count=_SCAN_COUNT)
                names.update(dict.fromkeys(batch))
                progress.add(len(batch))
        else:
            position: Any = b"0"
            while True:
                position, batch = await self._client.scan(position, match=pattern, count=_SCAN_COUNT)
                names.update(dict.fromkeys(batch))
                progress.add(len(batch))
                if position in (b"0", "0", 0):
                    break
        return list(names)

    async def ping(self) -> None:
        self.check_open()
        await self._client.ping()

    async def caveats(self) -> list[str]:
        """A ``maxmemory-policy`` that evicts keys without an expiry (`EVICTS_WITHOUT_EXPIRY`),
        which the identity's records and the engines' leases are (`for_records`): the server
        may evict them with the blocks (a record is written again at the next start, a lease
        at its next renewal; meanwhile a listing misses them, never a block's bytes); or a
        policy that cannot be read (``CONFIG`` renamed or refused, as managed services do)."""
        fix = "set ttl_s on the tier and a volatile-lru or volatile-lfu policy: only blocks are then evicted"
        where = ", ".join(f"{host}:{port}" for host, port in self._connection.addresses)
        try:
            answer = await self._client.custom_command(["CONFIG", "GET", "maxmemory-policy"])
            value = next(iter(answer.values())) if isinstance(answer, dict) else answer[1]  # RESP3, RESP2
            policy = value.decode() if isinstance(value, bytes) else str(value)
        except Exception as exc:  # refused, renamed, or an answer of another shape
            return [f"{where}: its maxmemory-policy cannot be read ({describe(exc)}); {fix}"]
        if policy not in EVICTS_WITHOUT_EXPIRY:
            return []
        return [
            f"{where}: maxmemory-policy {policy} evicts keys without an expiry, the identity's "
            f"records and the engines' leases among them (labels: written again at the next start and renewal); {fix}"
        ]
