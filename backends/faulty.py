"""The ``faulty`` tier: any block store, with failures, latency, hangs and corruption injected.

For tests and load runs that must show the engine survives a bad backend:

```yaml
secondary_tiers:
  - type: faulty
    inner: {type: file, root_dir: /tmp/kv}   # any block-store type, with that store's options
    failure_rate: 0.1        # each operation raises OSError with this probability
    corruption_rate: 0.01    # each successful read flips one byte of the block read
    latency_s: 0.002         # added to every operation
    hang_rate: 0.0           # each operation hangs (until its timeout) with this probability
```

Every block-store key (``capacity_bytes``, ``op_timeout_s`` ...) goes beside ``inner``, not in
it. Corruption happens below the adapter's checksum, so a corrupted block must be rejected,
never loaded. Loop thread: the store's coroutines; the options are checked where the config
is loaded.
"""

from __future__ import annotations

import errno
import random
from collections.abc import Collection, Mapping, Sequence
from typing import Any, ClassVar

import anyio
from pydantic import BaseModel, field_validator

from tiering.contract.keys import OffloadKey
from tiering.errors import TierConfigError
from tiering.options import STRICT, Delay, Probability, validate_options
from tiering.tiers.blockstore import BlockStore, BlockStoreSettings
from tiering.tiers.factory import SecondaryTierFactory
from tiering.tiers.object_format import ObjectHeader
from tiering.tiers.seal import Seal


class FaultyOptions(BaseModel):
    """Config keys of the ``faulty`` tier, besides every block-store tier's."""

    model_config = STRICT

    inner: dict[str, Any]
    failure_rate: Probability = 0.0
    corruption_rate: Probability = 0.0
    hang_rate: Probability = 0.0
    latency_s: Delay = 0.0
    seed: int | None = None

    @field_validator("inner")
    @classmethod
    def _inner_is_a_store(cls, inner: dict[str, Any]) -> dict[str, Any]:
        try:
            _inner_store(inner)
        except TierConfigError as exc:
            raise ValueError("; ".join(f"{path}: {message}" for path, message in exc.problems)) from None
        return inner


def _inner_store(inner: Mapping[str, Any]) -> tuple[type[BlockStore], BaseModel]:
    """The block-store class and validated options of an ``inner`` config.

    Raises:
        TierConfigError: not a block-store type, or bad options.
    """
    inner_type, inner_cls, options = SecondaryTierFactory.resolve(inner)
    if not issubclass(inner_cls, BlockStore):
        raise TierConfigError(f"tier type {inner_type!r}", [("type", "is not a block store; cannot be wrapped")])
    return inner_cls, validate_options(inner_cls.Options, options, f"tier type {inner_type!r}")


class FaultyBlockStore(BlockStore):
    """`inner` with faults injected into every operation (on the loop thread only).

    Args:
        inner: the store that holds the data.
        failure_rate, hang_rate, corruption_rate: probabilities, 0..1 (see the module).
        latency_s: seconds added to every operation.
        seed: seed of the fault draws, or None.
    """

    Options = FaultyOptions
    supports_integrity = True  # when its inner store does (`check_config`); the seal is the inner one's
    tier_defaults: ClassVar[dict[str, Any]] = {"max_concurrency": 16, "op_timeout_s": 5.0}

    @classmethod
    def from_config(cls, fingerprint: bytes, options: BaseModel, settings: BlockStoreSettings) -> FaultyBlockStore:
        """The inner store of ``inner``'s type and options, faults around it."""
        assert isinstance(options, FaultyOptions)
        inner_cls, inner_options = _inner_store(options.inner)
        inner = inner_cls.from_config(fingerprint, inner_options, settings)
        faults = options.model_dump(exclude={"inner"})
        return cls(inner, **faults)

    @classmethod
    def check_config(cls, options: BaseModel, settings: BlockStoreSettings) -> None:
        """``integrity`` only around an inner store that supports it.

        Raises:
            ValueError: ``integrity`` is set and the inner store cannot seal.
        """
        assert isinstance(options, FaultyOptions)
        inner_cls, _ = _inner_store(options.inner)
        if settings.integrity is not None and not inner_cls.supports_integrity:
            raise ValueError(f"integrity: the inner store {inner_cls.__name__} cannot seal its objects")

    def __init__(
        self,
        inner: BlockStore,
        failure_rate: float = 0.0,
        latency_s: float = 0.0,
        hang_rate: float = 0.0,
        corruption_rate: float = 0.0,
        seed: int | None = None,
    ):
        self.inner = inner
        super().__init__(inner.fingerprint)
        self.header_align = inner.header_align
        self.failure_rate, self.latency_s = failure_rate, latency_s
        self.hang_rate, self.corruption_rate = hang_rate, corruption_rate
        self._random = random.Random(seed)

    def __repr__(self) -> str:
        return f"FaultyBlockStore({self.inner!r})"

    @property  # type: ignore[override]  # the inner store seals, so the seal is the inner one's
    def seal(self) -> Seal | None:
        return self.inner.seal

    @seal.setter
    def seal(self, seal: Seal | None) -> None:
        self.inner.seal = seal

    @property  # type: ignore[override]  # where the inner store's blocks are
    def locality(self) -> str:
        return self.inner.locality

    @locality.setter
    def locality(self, locality: str) -> None:
        self.inner.locality = locality

    @property  # type: ignore[override]  # the inner store lays blocks out by their size
    def block_bytes(self) -> int | None:
        return self.inner.block_bytes

    @block_bytes.setter
    def block_bytes(self, block_bytes: int | None) -> None:
        self.inner.block_bytes = block_bytes

    @property  # type: ignore[override]  # the inner store places its objects
    def places_locally(self) -> bool:
        return self.inner.places_locally

    @places_locally.setter
    def places_locally(self, places: bool) -> None:
        self.inner.places_locally = places

    async def local_keys(self, keys: Sequence[OffloadKey]) -> set[OffloadKey]:
        return await self.inner.local_keys(keys)

    def for_records(self) -> BlockStore:
        return self.inner.for_records()

    async def ready(self) -> None:
        await self.inner.ready()

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

    async def undo_open(self) -> None:
        await super().close()
        await self.inner.undo_open()

    async def remove_namespace(self) -> None:
        await self.inner.remove_namespace()

    async def ping(self) -> None:
        await self._fault()
        await self.inner.ping()
