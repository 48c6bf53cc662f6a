"""The ``faulty`` tier: any block store, with failures, latency, hangs and corruption injected.

For tests and load runs that must show the engine survives a bad backend:

```yaml
secondary_tiers:
  - type: faulty
    inner: {type: file, root_dir: /tmp/kv}   # memory, file or s3, with that store's options
    failure_rate: 0.1        # each operation raises OSError with this probability
    corruption_rate: 0.01    # each successful read flips one byte of the block read
    latency_s: 0.002         # added to every operation
    hang_rate: 0.0           # each operation hangs (until its timeout) with this probability
```

Corruption happens below the adapter's CRC check, so a corrupted block must be rejected,
never loaded.
"""

from __future__ import annotations

import errno
import importlib
import random
from collections.abc import Collection
from typing import Any

import anyio
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from tiering.blockstore import BlockStore, BlockStoreTier
from tiering.factory import Count, Delay, Probability, Seconds, Size, describe_error, tier_options_model
from tiering.keys import OffloadKey
from tiering.object_format import ObjectHeader

STORES = {  # inner store types: module, class
    "memory": ("tiering.backends.memory", "MemoryBlockStore"),
    "file": ("tiering.backends.file", "FileBlockStore"),
    "s3": ("tiering.backends.s3", "S3BlockStore"),
}


class FaultyBlockStore(BlockStore):
    """`inner` with faults injected into every operation (on the loop thread only).

    Args:
        inner: the store that holds the data.
        failure_rate, hang_rate, corruption_rate: probabilities, 0..1 (see the module).
        latency_s: seconds added to every operation.
        seed: seed of the fault draws, or None.
    """

    def __init__(
        self,
        inner: BlockStore,
        failure_rate: float = 0.0,
        latency_s: float = 0.0,
        hang_rate: float = 0.0,
        corruption_rate: float = 0.0,
        seed: int | None = None,
    ):
        super().__init__(inner.fingerprint)
        self.inner = inner
        self.header_align = inner.header_align
        self.failure_rate, self.latency_s = failure_rate, latency_s
        self.hang_rate, self.corruption_rate = hang_rate, corruption_rate
        self._random = random.Random(seed)

    async def _fault(self) -> None:
        self.check_open()
        if self.latency_s:
            await anyio.sleep(self.latency_s)
        if self.hang_rate and self._random.random() < self.hang_rate:
            await anyio.sleep_forever()
        if self.failure_rate and self._random.random() < self.failure_rate:
            raise OSError(errno.EIO, "injected failure")

    async def open(self) -> None:
        await self.inner.open()
        await super().open()

    async def close(self) -> None:
        await super().close()
        await self.inner.close()

    async def put(self, key: OffloadKey, payload: memoryview) -> None:
        await self._fault()
        await self.inner.put(key, payload)

    async def get(self, key: OffloadKey, into: memoryview) -> ObjectHeader:
        await self._fault()
        header = await self.inner.get(key, into)
        if self.corruption_rate and self._random.random() < self.corruption_rate:
            view = into.cast("B")
            view[self._random.randrange(view.nbytes)] ^= 0x40
        return header

    async def exists(self, key: OffloadKey) -> bool:
        await self._fault()
        return await self.inner.exists(key)

    async def delete_many(self, keys: Collection[OffloadKey]) -> None:
        await self._fault()
        await self.inner.delete_many(keys)

    async def recover(self) -> list[tuple[OffloadKey, int]]:
        return await self.inner.recover()

    async def ping(self) -> None:
        await self._fault()
        await self.inner.ping()


def _store_class(store_type: str) -> type[BlockStore]:
    if store_type not in STORES:
        raise ValueError(f"unknown inner store type {store_type!r}; known types: {', '.join(STORES)}")
    module, name = STORES[store_type]
    return getattr(importlib.import_module(module), name)


class FaultyOptions(BaseModel):
    """The ``faulty`` tier's schema: the inner store's options are checked by its own."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    inner: dict[str, Any]
    failure_rate: Probability = 0.0
    corruption_rate: Probability = 0.0
    hang_rate: Probability = 0.0
    latency_s: Delay = 0.0
    seed: int | None = None
    capacity_bytes: Size | None = None
    max_concurrency: Count = 16
    op_timeout_s: Seconds = 5.0

    @field_validator("inner")
    @classmethod
    def _inner_store(cls, inner: dict[str, Any]) -> dict[str, Any]:
        options = dict(inner)
        store_cls = _store_class(str(options.pop("type", "")))
        model = tier_options_model(store_cls)
        try:
            checked = model.model_validate(options)
        except ValidationError as exc:
            known = list(model.model_fields)
            problems = [f"{'.'.join(map(str, e['loc']))}: {describe_error(e, known)}" for e in exc.errors()]
            raise ValueError("; ".join(problems)) from None
        return {"type": inner["type"], **{name: getattr(checked, name) for name in checked.model_fields_set}}


class FaultyTier(BlockStoreTier):
    """Tier type ``faulty``: a `FaultyBlockStore` over a memory, file or s3 store."""

    config_model = FaultyOptions

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str = "faulty",
        *,
        inner: dict[str, Any],
        failure_rate: float = 0.0,
        corruption_rate: float = 0.0,
        hang_rate: float = 0.0,
        latency_s: float = 0.0,
        seed: int | None = None,
        capacity_bytes: int | None = None,
        max_concurrency: int = 16,
        op_timeout_s: float = 5.0,
    ):
        """
        Args:
            inner: the inner store's ``type`` (memory, file, s3) and its options.
            failure_rate, corruption_rate, hang_rate, latency_s, seed: see `FaultyBlockStore`.
            capacity_bytes, max_concurrency, op_timeout_s: as for every block-store tier.

        Raises:
            ValueError: an unknown inner type or an option out of range.
        """
        options = dict(inner)
        store_cls = _store_class(str(options.pop("type", "")))

        def make_store(fingerprint: bytes) -> BlockStore:
            return FaultyBlockStore(
                store_cls(fingerprint=fingerprint, **options), failure_rate, latency_s, hang_rate, corruption_rate, seed
            )

        super().__init__(
            offloading_spec,
            primary_kv_view,
            tier_type,
            store_factory=make_store,
            capacity_bytes=capacity_bytes,
            max_concurrency=max_concurrency,
            op_timeout_s=op_timeout_s,
        )
