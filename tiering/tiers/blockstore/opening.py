"""What a block-store tier is built from: its stores (one per namespace), sealed where the
settings ask, the index sized for it, and the opening of its store on the loop.

Thread: the thread that builds the engine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from tiering.tiers.blockstore.index import BlockIndex
from tiering.tiers.blockstore.settings import BlockStoreSettings
from tiering.tiers.blockstore.store import BlockStore
from tiering.tiers.blockstore.worker import BlockWorker
from tiering.tiers.object_format import object_size
from tiering.tiers.runtime import AsyncRuntime
from tiering.tiers.seal import Seal

logger = logging.getLogger(__name__)


def store_maker(
    name: str, store_factory: Callable[[bytes], BlockStore], settings: BlockStoreSettings, row_bytes: int
) -> Callable[[bytes, bool], BlockStore]:
    """``make(namespace, blocks)``: tier `name`'s store of a 16-byte namespace, not opened
    yet, sealing its objects where `integrity` is set; `blocks` False for a store of records
    (`tiering.tiers.blockstore.generations`), whose objects are not the tier's rows. The
    settings are checked (and the integrity keys read) once, here.

    Raises:
        ValueError: `capacity_bytes` cannot hold one block of `row_bytes`; `integrity` is set
            and the store does not support it, or its keys cannot be read (see
            `tiering.tiers.seal.read_keys`).
    """
    seal = None if settings.integrity is None else Seal.from_config(settings.integrity, settings.encryption)

    def make(namespace: bytes, blocks: bool = True) -> BlockStore:
        store = store_factory(namespace)
        store.block_bytes = row_bytes if blocks else None
        if seal is not None:
            if not store.supports_integrity:
                raise ValueError(f"tier {name}: {type(store).__name__} cannot seal its objects")
            store.seal = seal
        return store

    probe = make(bytes(16))
    smallest = object_size(0, row_bytes, probe.header_align)
    if settings.capacity_bytes is not None and settings.capacity_bytes < smallest:
        raise ValueError(
            f"capacity_bytes ({settings.capacity_bytes}) cannot hold one block: a block takes at least "
            f"{smallest} bytes (a row of {row_bytes} and its header)"
        )
    return make


def new_index(
    name: str, settings: BlockStoreSettings, row_bytes: int, header_align: int, clock: Callable[[], float]
) -> BlockIndex:
    """An empty index for tier `name`, with retention deadlines for up to
    `retention_max_fraction` of the blocks `capacity_bytes` holds (none without a capacity)."""
    max_retained = 0
    if settings.capacity_bytes is not None:
        blocks = settings.capacity_bytes // object_size(0, row_bytes, header_align)
        max_retained = int(settings.retention_max_fraction * blocks)
    return BlockIndex(
        name, settings.capacity_bytes, clock=clock, max_keys=settings.index_max_blocks, max_retained=max_retained
    )


def open_worker(name: str, worker: BlockWorker, runtime: AsyncRuntime, timeout_s: float) -> None:
    """Open tier `name`'s records and store on the loop (`BlockWorker.open`), up to `timeout_s`;
    on failure `runtime` is released.

    Raises:
        TimeoutError: it did not open in time.
        OSError, TieringError: the store's own errors while opening.
    """
    sealed = f", sealing objects ({worker.store.seal!r})" if worker.store.seal else ""
    logger.info("tier %s: opening %r%s; recovering the blocks it holds meanwhile", name, worker.store, sealed)
    try:
        runtime.run_sync(worker.open, timeout_s=timeout_s)
    except BaseException as exc:
        runtime.release()
        if isinstance(exc, TimeoutError):
            raise TimeoutError(f"tier {name}: {worker.store!r} did not open in {timeout_s} s") from None
        raise
