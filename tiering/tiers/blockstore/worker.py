"""`BlockWorker`: the loop-thread half of a block-store tier.

Loop thread only: every method runs on the tier's event loop (the ``start_*`` methods as
callbacks the scheduler thread queued with `AsyncRuntime.submit`). It runs the store calls
in three lanes, each under `op_timeout_s`: loads and existence probes (what a request waits
for) at most `max_concurrency` at once, stores at most `max_concurrency` at once, and deletes
one call at a time, those queued meanwhile merged into the next (`Deletes`), so a promotion
never queues behind cascade writes or deletes. The store (or load) jobs queued by one run
of callbacks (a step's, mostly) start together and share their store calls
(`tiering.tiers.blockstore.batches`), each job finished as the last call with its blocks
ends. It fills in each job's outcome and puts it in the `Outbox`; it never touches the index.

Rules kept here: an evicted key's delete finishes before a new put of the same key starts;
a load's payload checksum or signature is checked above the store (a wrapping store is checked
too), off the loop, unless the store checked it as it read (`BlockStore.verifies_payloads`),
and an encrypted one is checked and decrypted there, once, whatever the store; an object
found corrupt or unusable is deleted, one whose seal does not open is left alone; each
loaded block's row is settled (`tiering.cpu.row_states`) once checked, before its outcome; a call
that does not return at its timeout keeps its job's rows in use until it does; every task
puts exactly one outcome.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from functools import partial
from typing import Any, TypeVar

import anyio
import anyio.abc
import anyio.to_thread
import numpy as np

from tiering.contract.keys import OffloadKey
from tiering.cpu.row_states import RowStates
from tiering.errors import HungCallError, RuntimeClosedError
from tiering.tiers.blockstore.batches import LOAD_SPREAD, Block, Items, QueuedJobs, cut, jobs_of
from tiering.tiers.blockstore.calls import StoreCalls
from tiering.tiers.blockstore.deletes import Deletes
from tiering.tiers.blockstore.generations import CurrentStore, Records
from tiering.tiers.blockstore.outbox import (
    DeletesDone,
    JobDone,
    LoadDone,
    Outbox,
    Outcome,
    PingDone,
    ProbeDone,
    RecoverDone,
    StoreDone,
)
from tiering.tiers.blockstore.settings import BlockStoreSettings
from tiering.tiers.blockstore.store import BlockStore
from tiering.tiers.object_format import ObjectHeader, open_payloads
from tiering.tiers.runtime import AsyncRuntime

T = TypeVar("T")
INLINE_CHECK_BYTES = 1 << 20  # a batch this small is checked on the loop (~50 us): a thread hop costs more


class BlockWorker:
    """Runs one store's calls for one tier.

    Args:
        name: the tier's name, for errors.
        records: the identity's `Records` in the tier's store; `store` is the block store of
            their current generation (opened by `open`, closed when serving ends, replaced
            by `start_switch`).
        rows: the primary rows, a 2-D uint8 array ``(num_blocks, row_bytes)``.
        outbox: where outcomes go.
        settings: the tier's; ``max_concurrency`` store calls in flight at once, each up to ``op_timeout_s``.
        batch_blocks: blocks per `put_many`/`get_many` call.
        runtime: the tier's runtime, told when each job starts and ends (so its loop
            polls for work while jobs run, see `AsyncRuntime.job_started`).
    """

    def __init__(
        self,
        name: str,
        records: Records,
        rows: np.ndarray,
        outbox: Outbox,
        settings: BlockStoreSettings,
        batch_blocks: int,
        runtime: AsyncRuntime,
    ):
        self.name = name
        self._current = CurrentStore(records)
        self._rows = rows
        self._row_bytes = rows.shape[1]
        self._flat_rows = rows.data.cast("B") if rows.flags.c_contiguous else None  # rows as slices, cheaply
        self._outbox = outbox
        self._store_lane = asyncio.Semaphore(settings.max_concurrency)
        self._load_lane = asyncio.Semaphore(settings.max_concurrency)
        self._calls = StoreCalls(settings.op_timeout_s, outbox)
        self.deletes = Deletes(self._calls)
        self._batch_blocks = batch_blocks
        self._runtime = runtime
        self._serving = False  # jobs start only while the worker serves
        self._jobs: set[asyncio.Task[None]] = set()  # a task per job, until it ends
        self._deleting: dict[OffloadKey, anyio.Event] = {}
        self._loads_in_flight = 0  # load jobs started and not finished
        self._queued_stores = QueuedJobs()  # jobs that start together at the end of this run of callbacks
        self._queued_loads = QueuedJobs()
        self._stop = anyio.Event()
        self._stopped = anyio.Event()
        self.row_states: RowStates | None = None  # set by the tier: promoted rows are settled as they land

    @property
    def store(self) -> BlockStore:
        """The block store of the current generation."""
        return self._current.store

    async def open(self) -> None:
        """Open the records (`Records.open`) and the store of the current generation they
        name, and start serving in the runtime's task group (what the store holds is read by
        `start_recover`).

        Raises:
            Exception: whatever opening the store raised (it is closed again, and what its
                opening created is removed: `BlockStore.undo_open`).
        """
        await self._current.records.open()
        self._current.store = self._current.records.store()
        try:
            await self.store.open()
            try:
                await self._runtime.task_group.start(self._serve)
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await self.store.undo_open()
                raise
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._current.records.close(remove=True)
            raise

    async def stop(self) -> None:
        """Cancel every task (each still puts its outcome, as failed) and close the store."""
        self._stop.set()
        await self._stopped.wait()

    async def _serve(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve until `stop` (or the runtime's end): then cancel every job, wait for every
        store call to return (a call is cancelled through its own scope, which a store's
        shield respects: a thread may still write into its rows) and close the store."""
        self._serving = True
        task_status.started()
        try:
            await self._stop.wait()
        finally:
            self._serving = False
            with anyio.CancelScope(shield=True):
                await asyncio.sleep(0)  # every job takes its first step: cancelled before it, it skips its `finally`
                for job in self._jobs:
                    job.cancel()
                await self._current.records.close()  # not behind a call stuck in the blocks' store
                while self._jobs or self._calls.running:
                    await asyncio.wait(self._jobs | self._calls.running)
                await self.store.close()
                self._stopped.set()

    def _spawn(self, tasks: set[asyncio.Task[None]], coroutine: Coroutine[Any, Any, None]) -> None:
        """Run `coroutine` as a plain asyncio task kept in `tasks` until it ends (a tenth of
        an anyio task group's cost per task)."""
        task = asyncio.get_running_loop().create_task(coroutine)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    # -- entry points, queued by the scheduler thread ---------------------------------------

    def start_store(self, done: StoreDone, items: Items, after_deletes: bool = False) -> None:
        """Store `items`, once the deletes of their keys started before it are over, or,
        with `after_deletes` (a full device, whose room those deletes make), every delete
        started before it; with the other stores queued by this run of callbacks (`_queue`)."""
        self._queue(self._queued_stores, done, items, lambda: self._store_waits(items, after_deletes))

    def start_load(self, done: LoadDone, items: Items) -> None:
        """Load `items` into their rows, with the other loads queued by this run of callbacks."""
        self._loads_in_flight += 1  # until `_finish`, which every started job reaches
        self._queue(self._queued_loads, done, items, list)

    def start_probe(self, done: ProbeDone) -> None:
        self._start(done, lambda: partial(self._probe, done=done))

    def start_recover(self, done: RecoverDone, timeout_s: float) -> None:
        """List what the store holds (`BlockStore.recover`, up to `timeout_s`) into ``done.found``."""
        self._start(done, lambda: partial(self._recover, done=done, timeout_s=timeout_s))

    def start_ping(self, done: PingDone) -> None:
        self._start(done, lambda: partial(self._ping, done=done))

    def start_delete(self, done: DeletesDone) -> None:
        self._start(done, partial(self._delete_job, done, done.keys))

    def start_switch(self, open_next: Callable[[], Awaitable[BlockStore]]) -> None:
        """Move to the store `open_next` opens (a new generation's, `Records.open_next`): jobs
        queued or started before run on the old store to their end; jobs started until it is
        open wait for it (`_ready`); the old store is then retired (`generations.retire`)."""
        for queue in (self._queued_stores, self._queued_loads):
            self._start_queued(queue)  # bound to the old store
        if self._serving:
            self._spawn(self._jobs, self._current.switch(open_next, self._jobs | self._calls.running))

    def _start(self, done: Outcome, prepare: Callable[[], Callable[[BlockStore], Awaitable[None]]]) -> None:
        """Run the job ``prepare()`` returns, on the current store (`_ready`), as a task of
        its own (`_spawn`). If the tier is stopped, or anything raises while starting, the
        outcome is put at once, failed: never lost."""
        self._runtime.job_started()
        try:
            self._check_serving()
            self._spawn(self._jobs, self._run(done, prepare(), self._current.ready()))
        except Exception as exc:
            if self._serving:
                done.failed("start", exc, sick=False)
            self._finish(done, broken=True)

    def _store_waits(self, items: Items, after_deletes: bool) -> list[anyio.Event]:
        """The deletes a store of `items` waits for: of its keys, or, `after_deletes`, all."""
        if after_deletes:
            return list(self._deleting.values())
        return [event for key, _ in items if (event := self._deleting.get(key)) is not None]

    def _queue(self, queue: QueuedJobs, done: JobDone, items: Items, waits: Callable[[], list[anyio.Event]]) -> None:
        """Queue a store or load job; the jobs queued until the loop's next turn start
        together, as one task whose store calls they share (`tiering.tiers.blockstore.batches`).
        If the tier is stopped, or anything raises while queueing, the outcome is put at
        once, failed: never lost."""
        self._runtime.job_started()
        try:
            self._check_serving()
            for event in waits():
                queue.waits[id(event)] = event
            if not queue.jobs:
                asyncio.get_running_loop().call_soon(self._start_queued, queue)
            queue.jobs.append((done, items))
        except Exception as exc:
            if self._serving:
                done.failed("start", exc, sick=False)
            self._finish(done, broken=True)

    def _check_serving(self) -> None:
        if not self._serving:
            raise RuntimeClosedError(f"tier {self.name} is shut down")

    def _start_queued(self, queue: QueuedJobs) -> None:
        """Start the jobs of `queue` as one task (failed at once if the tier stopped since)."""
        jobs, waits = queue.jobs, list(queue.waits.values())
        queue.jobs, queue.waits = [], {}
        if not jobs:  # started early, by a switch of stores
            return
        if not self._serving:
            for done, _ in jobs:
                self._finish(done, broken=True)
            return
        self._spawn(self._jobs, self._run_together(jobs, waits, self._current.ready()))

    async def _run_together(
        self, jobs: list[tuple[JobDone, Items]], waits: list[anyio.Event], ready: BlockStore | anyio.Event
    ) -> None:
        """Run store or load jobs started together: wait for `waits`, then their blocks in
        shared calls. Each job is finished once the calls with its blocks are over; if
        anything raises (a bug here or in a store), the jobs not finished fail."""
        broken = False
        try:
            store = await self._current.of(ready)
            for deleted in waits:
                await deleted.wait()
            blocks = [(done, key, row) for done, items in jobs for key, row in items]
            if isinstance(jobs[0][0], LoadDone):
                spread = LOAD_SPREAD if len(jobs) == self._loads_in_flight == 1 else 1
                await self._in_batches(partial(self._load_batch, store), blocks, spread)
            else:
                await self._in_batches(partial(self._store_batch, store), blocks)
        except Exception as exc:
            broken = True
            for done, _ in jobs:
                if not done.reported:
                    done.failed("internal", exc, sick=False)
        finally:
            for done, _ in jobs:
                if not done.reported:
                    self._finish(done, broken)

    def _delete_job(self, done: DeletesDone, keys: list[OffloadKey]) -> Callable[[BlockStore], Awaitable[None]]:
        """The delete job; stores of these keys started after it wait for it."""
        deleted = anyio.Event()
        self._deleting.update(dict.fromkeys(keys, deleted))
        return partial(self._delete, done=done, keys=keys, deleted=deleted)

    async def _run(
        self, done: Outcome, job: Callable[[BlockStore], Awaitable[None]], ready: BlockStore | anyio.Event
    ) -> None:
        broken = False
        try:
            await job(await self._current.of(ready))
        except Exception as exc:  # a bug here or in a store: this job fails, the tier goes on
            done.failed("internal", exc, sick=False)
            broken = True
        finally:
            self._finish(done, broken)

    def _finish(self, done: Outcome, broken: bool) -> None:
        if isinstance(done, LoadDone):
            self._loads_in_flight -= 1
        if isinstance(done, JobDone):
            done.complete = done.complete and not broken
            done.rows_in_use, done.reported = done.hung > 0, True
        self._runtime.job_finished()
        self._outbox.put(done)

    # -- jobs -------------------------------------------------------------------------------

    async def _in_batches(
        self,
        run_batch: Callable[[Sequence[Block]], Coroutine[Any, Any, None]],
        blocks: Sequence[Block],
        spread: int = 1,
    ) -> None:
        """`run_batch` over `blocks` cut into calls (`batches.cut`), concurrently; each job is
        finished as the last call with its blocks ends."""
        store = self.store
        batches, at_once = cut(
            blocks, self._batch_blocks, self._row_bytes, spread, store.reads_in_order, store.calls_at_once
        )
        calls_left: dict[int, int] = {}
        for batch in batches:
            for done in jobs_of(batch):
                calls_left[id(done)] = calls_left.get(id(done), 0) + 1

        async def run(batch: Sequence[Block]) -> None:
            await run_batch(batch)
            for done in jobs_of(batch):
                calls_left[id(done)] -= 1
                if not calls_left[id(done)]:
                    self._finish(done, broken=False)

        if len(batches) == 1:
            await run(batches[0])
            return
        running = anyio.CapacityLimiter(at_once)

        async def run_when_its_turn_comes(batch: Sequence[Block]) -> None:
            async with running:
                await run(batch)

        async with anyio.create_task_group() as task_group:
            for batch in batches:
                task_group.start_soon(run_when_its_turn_comes, batch)

    async def _store_batch(self, store: BlockStore, batch: Sequence[Block]) -> None:
        await store.ready()  # a listing at start is not a hung call: waited for before the call's timeout
        outcomes = await self._io(self._store_lane, store.put_many, batch)
        asked: list[tuple[StoreDone, OffloadKey]] = []  # stored, for jobs that keep events
        for (done, key, _), error in zip(batch, outcomes, strict=True):
            assert isinstance(done, StoreDone)
            if done.block_stored(key, error) and done.wants_local:
                asked.append((done, key))
        if asked and store.places_locally:  # which sit in this engine's own memory (a failure: none)
            local = await self._calls.call((), self._store_lane, store.local_keys, [key for _, key in asked])
            for done, key in asked:
                if not isinstance(local, Exception) and key in local:
                    done.local.add(key)

    async def _load_batch(self, store: BlockStore, batch: Sequence[Block]) -> None:
        await store.ready()
        outcomes = await self._io(self._load_lane, store.get_many, batch)
        errors: list[Exception | None] = [None if isinstance(o, ObjectHeader) else o for o in outcomes]
        verified = store.verifies_payloads
        unchecked = [i for i, o in enumerate(outcomes) if isinstance(o, ObjectHeader) and (o.encrypted or not verified)]
        if unchecked:  # checked above every store layer; off the loop unless it is quick
            checks = [(outcomes[i], self._row(batch[i][2])) for i in unchecked]
            if len(checks) * self._row_bytes <= INLINE_CHECK_BYTES:
                opened = open_payloads(checks, store.seal)
            else:
                opened = await anyio.to_thread.run_sync(open_payloads, checks, store.seal)
            for i, check in zip(unchecked, opened, strict=True):
                errors[i] = check
        settle = self.row_states.settle if self.row_states is not None else None
        corrupt: list[Block] = []
        for block, error in zip(batch, errors, strict=True):
            done, key, row = block
            assert isinstance(done, LoadDone)
            if settle is not None:  # before the outcome: a load may be waiting for this row
                settle(row, ok=error is None)
            if error is None:
                done.ok.add(key)
            elif done.block_failed(key, error):
                corrupt.append(block)
        if corrupt:
            await self._delete(store, corrupt[0][0], [key for _, key, _ in corrupt], None)

    async def _io(
        self, lane: asyncio.Semaphore, operation: Callable[..., Awaitable[list[T]]], batch: Sequence[Block]
    ) -> list[Any]:
        """One store call for a batch (`StoreCalls.call`); if the call itself fails, every
        block of the batch fails with its error."""
        outcome = await self._calls.call(
            jobs_of(batch), lane, operation, [(key, self._row(row)) for _, key, row in batch]
        )
        if isinstance(outcome, Exception):
            return [outcome] * len(batch)
        if len(outcome) != len(batch):
            raise RuntimeError(f"{type(self.store).__name__}: {len(outcome)} outcomes for {len(batch)} blocks")
        return outcome

    def _row(self, row: int) -> memoryview:
        """Primary row `row`'s bytes."""
        if self._flat_rows is None:
            return memoryview(self._rows[row])
        return self._flat_rows[row * self._row_bytes : (row + 1) * self._row_bytes]

    async def _probe(self, store: BlockStore, done: ProbeDone) -> None:
        outcome = await self._calls.call((), self._load_lane, store.exists_many, done.keys)
        outcomes = [outcome] * len(done.keys) if isinstance(outcome, Exception) else outcome
        for key, found in zip(done.keys, outcomes, strict=True):
            if isinstance(found, Exception):
                done.failed("probe", found)
            elif found:
                done.found.add(key)

    async def _recover(self, store: BlockStore, done: RecoverDone, timeout_s: float) -> None:
        try:
            with anyio.fail_after(timeout_s):
                done.found = await store.recover()
        except Exception as exc:
            done.found = []
            done.failed("recover", exc, sick=False)

    async def _ping(self, store: BlockStore, done: PingDone) -> None:
        outcome = await self._calls.call((), self._load_lane, store.ping)
        if isinstance(outcome, Exception):
            done.failed("ping", outcome)

    async def _delete(
        self, store: BlockStore, done: Outcome, keys: list[OffloadKey], deleted: anyio.Event | None
    ) -> None:
        """Delete `keys`; a failure is recorded once, in `done` (the first job that found them
        corrupt, or the deletes' own outcome). Sets `deleted` after."""
        try:
            outcome = await self.deletes.delete(store, keys)
            if outcome is not None:  # a failed delete is no sign of a sick backend; a hung one is
                done.failed("delete", outcome, sick=isinstance(outcome, HungCallError))
        finally:
            if deleted is not None:
                deleted.set()
                for key in keys:
                    if self._deleting.get(key) is deleted:
                        del self._deleting[key]
