"""`Deletes`: a block-store tier's deletes, one `BlockStore.delete_many` call at a time, and
the deletes that queued behind a call merged into the next one.

Every evicting step sends a delete. One call at a time keeps them from crowding out loads and
stores, and merging what queued meanwhile keeps a backlog at one call per turn of the lane,
where a call each left a backend slower than the steps further behind at every step.

Loop thread only.
"""

from __future__ import annotations

import asyncio

from tiering.contract.keys import OffloadKey
from tiering.tiers.blockstore.calls import StoreCalls
from tiering.tiers.blockstore.store import BlockStore


class Deletes:
    """The deletes of one worker, made through `calls` (their timeouts, hung calls)."""

    def __init__(self, calls: StoreCalls):
        self._calls = calls
        self._lane = asyncio.Semaphore(1)
        self._queued: list[tuple[BlockStore, list[OffloadKey], asyncio.Future[Exception | None]]] = []
        self._drain: asyncio.Task[None] | None = None
        self.calls = 0  # `delete_many` calls made

    async def delete(self, store: BlockStore, keys: list[OffloadKey]) -> Exception | None:
        """Delete `keys` from `store` in the next call: None, or the exception that call
        raised (`HungCallError` if it gave no answer in time: `StoreCalls.call`)."""
        done: asyncio.Future[Exception | None] = asyncio.get_running_loop().create_future()
        self._queued.append((store, keys, done))
        if self._drain is None:
            self._drain = asyncio.ensure_future(self._run())
        return await done

    async def _run(self) -> None:
        """Make calls while deletes are queued, each carrying all those of one store."""
        batch: list[tuple[BlockStore, list[OffloadKey], asyncio.Future[Exception | None]]] = []
        try:
            while self._queued:
                batch, self._queued = self._queued, []
                for store in dict.fromkeys(store for store, _, _ in batch):  # a store per generation
                    group = [(keys, done) for each, keys, done in batch if each is store]
                    merged = list(dict.fromkeys(key for keys, _ in group for key in keys))
                    self.calls += 1
                    outcome: Exception | None
                    try:  # not within the call's timeout: a listing at start is not a hung call
                        await store.ready()
                    except Exception as exc:  # a store's bug: these deletes fail, the next ones go on
                        outcome = exc
                    else:
                        outcome = await self._calls.call((), self._lane, store.delete_many, merged)
                    for _, done in group:
                        if not done.done():
                            done.set_result(outcome if isinstance(outcome, Exception) else None)
        finally:
            self._drain = None
            for _, _, done in batch + self._queued:  # cancelled (the loop is closing): their callers too
                done.cancel()
            self._queued = []
