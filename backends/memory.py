"""The ``memory`` tier: blocks in a dict of this process, optionally slow or faulty.

Injected latency and failures make it a stand-in for a remote tier in tests and in the
load generator. Objects use the stored format (header + checksum), so corruption is caught here
exactly as on disk.

Thread: the store's coroutines run on the tier's event loop; `MemoryOptions` where the
config is loaded.
"""

from __future__ import annotations

import random
from collections.abc import Collection

import anyio
from pydantic import BaseModel

from tiering.contract.keys import OffloadKey
from tiering.errors import ObjectNotFoundError
from tiering.options import STRICT, Delay, Probability
from tiering.tiers.blockstore import BlockStore
from tiering.tiers.object_format import ObjectHeader, check_length, encode_object, parse_header


class MemoryOptions(BaseModel):
    """Config keys of the ``memory`` tier, besides every block-store tier's."""

    model_config = STRICT

    latency_s: Delay = 0.0
    failure_rate: Probability = 0.0
    seed: int | None = None


class MemoryBlockStore(BlockStore):
    """Objects as `bytearray`s in a dict (on the loop thread only). Tier type ``memory``.

    Args:
        fingerprint: the layout fingerprint.
        latency_s: seconds every operation sleeps first.
        failure_rate: probability, 0..1, that an operation raises `OSError` after sleeping.
        seed: seed of the failure draws, or None for a random one.
    """

    Options = MemoryOptions
    supports_integrity = True
    lasting = False

    def __init__(self, fingerprint: bytes, latency_s: float = 0.0, failure_rate: float = 0.0, seed: int | None = None):
        super().__init__(fingerprint)
        if latency_s < 0 or not 0.0 <= failure_rate <= 1.0:
            raise ValueError(f"latency_s must be >= 0 and failure_rate within 0..1, got {latency_s}, {failure_rate}")
        self.latency_s = latency_s
        self.failure_rate = failure_rate
        self._random = random.Random(seed)
        self.objects: dict[OffloadKey, bytearray] = {}

    def __repr__(self) -> str:
        return f"MemoryBlockStore({len(self.objects)} objects)"

    async def _operation(self) -> None:
        self.check_open()
        if self.latency_s:
            await anyio.sleep(self.latency_s)
        if self.failure_rate and self._random.random() < self.failure_rate:
            raise OSError("injected failure")

    async def put(self, key: OffloadKey, payload: memoryview) -> None:
        await self._operation()
        header, body = encode_object(key, payload, self.fingerprint, seal=self.seal)
        self.objects[key] = bytearray(header) + body

    async def get(self, key: OffloadKey, into: memoryview) -> ObjectHeader:
        await self._operation()
        into = into.cast("B")
        stored = self.objects.get(key)
        if stored is None:
            raise ObjectNotFoundError(key)
        header = parse_header(stored, self.fingerprint, key, self.seal)
        payload = memoryview(stored)[header.size :]
        check_length(header, payload.nbytes, into.nbytes)
        into[:] = payload
        return header

    async def exists(self, key: OffloadKey) -> bool:
        await self._operation()
        return key in self.objects

    async def delete_many(self, keys: Collection[OffloadKey]) -> None:
        await self._operation()
        for key in keys:
            self.objects.pop(key, None)

    async def recover(self) -> list[tuple[OffloadKey, int]]:
        self.check_open()
        return [(key, len(obj)) for key, obj in self.objects.items()]
