"""An example third-party tier: a block store of five coroutines behind the adapter.

The adapter (`tiering.BlockStoreTier`) brings the index, capacity and LRU eviction, the
concurrency limit, timeouts, health, CRC verification and job reporting; a store only moves
bytes. Its options are the tier class's keyword arguments: they are its config schema.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from tiering import BlockStoreTier, ObjectNotFoundError, OffloadKey
from tiering.backends import BlockStore
from tiering.object_format import ObjectHeader, check_length, encode_header, parse_header


class DictStore(BlockStore):
    """Objects (header + payload, the engine's format) in a dict."""

    def __init__(self, fingerprint: bytes):
        super().__init__(fingerprint)
        self.objects: dict[OffloadKey, bytes] = {}

    async def put(self, key: OffloadKey, payload: memoryview) -> None:
        self.check_open()
        self.objects[key] = encode_header(key, payload, self.fingerprint) + bytes(payload)

    async def get(self, key: OffloadKey, into: memoryview) -> ObjectHeader:
        self.check_open()
        stored = self.objects.get(key)
        if stored is None:
            raise ObjectNotFoundError(key)
        header = parse_header(stored, self.fingerprint, key)
        check_length(header, len(stored) - header.size, into.nbytes)
        into.cast("B")[:] = stored[header.size :]
        return header

    async def exists(self, key: OffloadKey) -> bool:
        self.check_open()
        return key in self.objects

    async def delete_many(self, keys: Collection[OffloadKey]) -> None:
        self.check_open()
        for key in keys:
            self.objects.pop(key, None)

    async def recover(self) -> list[tuple[OffloadKey, int]]:
        self.check_open()
        return [(key, len(stored)) for key, stored in self.objects.items()]


class DictStoreTier(BlockStoreTier):
    """Tier type ``dictstore``; config keys ``capacity_bytes`` and ``max_concurrency``."""

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str = "dictstore",
        *,
        capacity_bytes: int | None = None,
        max_concurrency: int = 8,
    ):
        super().__init__(
            offloading_spec,
            primary_kv_view,
            tier_type,
            store_factory=DictStore,
            capacity_bytes=capacity_bytes,
            max_concurrency=max_concurrency,
        )
