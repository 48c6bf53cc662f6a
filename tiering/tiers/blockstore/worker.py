"""`BlockWorker`: the loop-thread half of a block-store tier.

Loop thread only: every method runs on the tier's event loop (the ``start_*`` methods as
callbacks the scheduler thread queued with `AsyncRuntime.submit`). It runs the store calls
in three lanes, each under `op_timeout_s`: loads and existence probes (what a request waits
for) at most `max_concurrency` at once, stores at most `max_concurrency` at once, and deletes
one call at a time, so a promotion never queues behind cascade writes or deletes. It fills
in the job's outcome and puts it in the `Outbox`; it never touches the index.

Rules kept here: an evicted key's delete finishes before a new put of the same key starts;
a load's payload CRC or signature is checked above the store (a wrapping store is checked
too), off the loop, unless the store checked it as it read (`BlockStore.verifies_payloads`),
and an encrypted one is checked and decrypted there, once, whatever the store; an object
found corrupt or unusable is deleted, one whose seal does not open is left alone; each
loaded block's row is settled (`tiering.cpu.row_states`) once checked, before its outcome; a call
that does not return at its timeout keeps its job's rows in use until it does; every task
puts exactly one outcome.
"""

from __future__ import annotations

import asyncio
import errno
import math
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from functools import partial
from typing import Any, TypeVar

import anyio
import anyio.abc
import anyio.to_thread
import numpy as np

from tiering.contract.keys import OffloadKey
from tiering.cpu.row_states import RowStates
from tiering.errors import (
    CorruptObjectError,
    HungCallError,
    RuntimeClosedError,
)
from tiering.tiers.blockstore.outbox import (
    DeletesDone,
    JobDone,
    LoadDone,
    Outbox,
    Outcome,
    PingDone,
    ProbeDone,
    RowsReleased,
    StoreDone,
)
from tiering.tiers.blockstore.store import BlockStore
from tiering.tiers.object_format import ObjectHeader, open_payload
from tiering.tiers.runtime import AsyncRuntime
from tiering.tiers.seal import Seal

T = TypeVar("T")
Items = Sequence[tuple[OffloadKey, int]]  # (key, primary row)
INLINE_CHECK_BYTES = 1 << 20  # a batch this small is checked on the loop (~50 us): a thread hop costs more
LOAD_SPREAD = 4
"""A promotion that is the tier's only load in flight reaches the store in up to this many
concurrent calls (each at most ``batch_bytes`` and, unless the whole job is smaller, at least
`LOAD_SPREAD_MIN_BYTES`): a request waits on it, and a device reads faster at a queue depth
above one (this VM's disk: 16 MiB of 512 KiB files with O_DIRECT in 13 ms from one thread, 9
ms from four). A store that `reads_in_order` gets calls of about `LOAD_SPREAD_MIN_BYTES`,
this many at a time: each call's rows land as it ends, and the worker copies them while the
next calls read. While other loads are in flight their calls already keep the device busy,
and a promotion goes in batches of ``batch_bytes``, as stores always do: each call costs the
loop about 150 us (2 MiB blocks from the page cache, one per call, read at 3.5 GB/s, in
batches of 16 MiB at 5.3-5.9, see peer-bench's ab_file)."""
LOAD_SPREAD_MIN_BYTES = 2 << 20
"""Below this a call costs more in hops than its reads gain in parallel (64 KiB blocks from
the page cache: a 16-block job read at 0.42 GB/s in four calls, see peer-bench's ab_file)."""


class BlockWorker:
    """Runs one store's calls for one tier.

    Args:
        name: the tier's name, for errors.
        store: the block store (opened by `serve`, closed when it ends).
        rows: the primary rows, a 2-D uint8 array ``(num_blocks, row_bytes)``.
        outbox: where outcomes go.
        max_concurrency: store calls in flight at once.
        op_timeout_s: seconds a store call may take.
        batch_blocks: blocks per `put_many`/`get_many` call.
        runtime: the tier's runtime, told when each job starts and ends (so its loop
            polls for work while jobs run, see `AsyncRuntime.job_started`).
    """

    def __init__(
        self,
        name: str,
        store: BlockStore,
        rows: np.ndarray,
        outbox: Outbox,
        max_concurrency: int,
        op_timeout_s: float,
        batch_blocks: int,
        runtime: AsyncRuntime,
    ):
        self.name = name
        self.store = store
        self._rows = rows
        self._row_bytes = rows.shape[1]
        self._flat_rows = rows.data.cast("B") if rows.flags.c_contiguous else None  # rows as slices, cheaply
        self._outbox = outbox
        self._store_lane = asyncio.Semaphore(max_concurrency)
        self._load_lane = asyncio.Semaphore(max_concurrency)
        self._delete_lane = asyncio.Semaphore(1)
        self._op_timeout_s = op_timeout_s
        self._batch_blocks = batch_blocks
        self._runtime = runtime
        self._serving = False  # jobs start only while the worker serves
        self._jobs: set[asyncio.Task[None]] = set()  # a task per job, until it ends
        self._calls: set[asyncio.Task[None]] = set()  # a task per store call, until it returns
        self._deleting: dict[OffloadKey, anyio.Event] = {}
        self._loads_in_flight = 0  # load jobs started and not finished
        self._stop = anyio.Event()
        self._stopped = anyio.Event()
        self.row_states: RowStates | None = None  # set by the tier: promoted rows are settled as they land

    async def open(self) -> list[tuple[OffloadKey, int]]:
        """Open the store, read what it holds, and start serving in the runtime's task group.

        Returns:
            (key, object bytes) of every object found, oldest first.
        Raises:
            Exception: whatever opening or recovering the store raised (it is closed again,
                and what its opening created is removed: `BlockStore.undo_open`).
        """
        await self.store.open()
        try:
            recovered = await self.store.recover()
            await self._runtime.task_group.start(self._serve)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.store.undo_open()
            raise
        return recovered

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
                while self._jobs or self._calls:
                    await asyncio.wait(self._jobs | self._calls)
                await self.store.close()
                self._stopped.set()

    def _spawn(self, tasks: set[asyncio.Task[None]], coroutine: Coroutine[Any, Any, None]) -> None:
        """Run `coroutine` as a plain asyncio task kept in `tasks` until it ends (a tenth of
        an anyio task group's cost per task: two tasks per job)."""
        task = asyncio.get_running_loop().create_task(coroutine)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    # -- entry points, queued by the scheduler thread ---------------------------------------

    def start_store(self, done: StoreDone, items: Items, after_deletes: bool = False) -> None:
        """Store `items`, once the deletes of their keys started before it are over, or,
        with `after_deletes` (a full device, whose room those deletes make), every delete
        started before it."""
        self._start(done, partial(self._store_job, done, items, after_deletes))

    def start_load(self, done: LoadDone, items: Items) -> None:
        self._loads_in_flight += 1  # until `_finish`, which every started job reaches
        self._start(done, lambda: partial(self._load_blocks, done, items))

    def start_probe(self, done: ProbeDone) -> None:
        self._start(done, lambda: partial(self._probe, done))

    def start_ping(self, done: PingDone) -> None:
        self._start(done, lambda: partial(self._ping, done))

    def start_delete(self, keys: list[OffloadKey]) -> None:
        done = DeletesDone(keys=keys)
        self._start(done, partial(self._delete_job, done, keys))

    def _start(self, done: Outcome, prepare: Callable[[], Callable[[], Awaitable[None]]]) -> None:
        """Run the job ``prepare()`` returns as a task of its own (`_spawn`). If the tier is
        stopped, or anything raises while starting, the outcome is put at once, failed:
        never lost."""
        self._runtime.job_started()
        try:
            if not self._serving:
                raise RuntimeClosedError(f"tier {self.name} is shut down")
            self._spawn(self._jobs, self._run(done, prepare()))
        except Exception as exc:
            if self._serving:
                done.failed("start", exc, sick=False)
            self._finish(done, broken=True)

    def _store_job(self, done: StoreDone, items: Items, after_deletes: bool) -> Callable[[], Awaitable[None]]:
        """The store job, waiting first for the deletes started before it: of its keys, or all."""
        if after_deletes:
            events = list(self._deleting.values())
        else:
            events = [event for key, _ in items if (event := self._deleting.get(key)) is not None]
        waits = list({id(event): event for event in events}.values())
        return partial(self._store_blocks, done, items, waits)

    def _delete_job(self, done: DeletesDone, keys: list[OffloadKey]) -> Callable[[], Awaitable[None]]:
        """The delete job; stores of these keys started after it wait for it."""
        deleted = anyio.Event()
        self._deleting.update(dict.fromkeys(keys, deleted))
        return partial(self._delete, done, keys, deleted)

    async def _run(self, done: Outcome, job: Callable[[], Awaitable[None]]) -> None:
        broken = False
        try:
            await job()
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

    async def _store_blocks(self, done: StoreDone, items: Items, waits: list[anyio.Event]) -> None:
        for deleted in waits:
            await deleted.wait()
        await self._in_batches(self._store_batch, done, items)

    async def _load_blocks(self, done: LoadDone, items: Items) -> None:
        spread = LOAD_SPREAD if self._loads_in_flight == 1 else 1
        await self._in_batches(self._load_batch, done, items, spread)

    async def _in_batches(
        self,
        run_batch: Callable[[Any, Items], Coroutine[Any, Any, None]],
        done: JobDone,
        items: Items,
        spread: int = 1,
    ) -> None:
        """`run_batch` over `items`, concurrently, in batches of at most ``batch_blocks``;
        with `spread`, in up to `spread` batches of at least `LOAD_SPREAD_MIN_BYTES`, or, for
        a store that `reads_in_order`, in batches of about that size, `spread` at a time in
        the order of `items`."""
        size, at_once = self._batch_blocks, math.inf
        if spread > 1:
            least = max(1, LOAD_SPREAD_MIN_BYTES // max(1, self._row_bytes))
            if self.store.reads_in_order:
                size, at_once = min(size, least), spread
            else:
                size = min(size, max(least, -(-len(items) // spread)))
        if len(items) <= size:
            await run_batch(done, items)
            return
        running = anyio.CapacityLimiter(at_once)

        async def run_when_its_turn_comes(batch: Items) -> None:
            async with running:
                await run_batch(done, batch)

        async with anyio.create_task_group() as task_group:
            for start in range(0, len(items), size):
                task_group.start_soon(run_when_its_turn_comes, items[start : start + size])

    async def _store_batch(self, done: StoreDone, batch: Items) -> None:
        for (key, _), error in zip(batch, await self._io(done, self.store.put_many, batch), strict=True):
            if error is None:
                done.ok.add(key)
            elif isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
                done.failed("store_no_space", error, sick=False)
                done.no_space += 1
            else:
                done.failed("store", error)

    async def _load_batch(self, done: LoadDone, batch: Items) -> None:
        outcomes = await self._io(done, self.store.get_many, batch)
        errors: list[Exception | None] = [None if isinstance(o, ObjectHeader) else o for o in outcomes]
        verified = self.store.verifies_payloads
        unchecked = [i for i, o in enumerate(outcomes) if isinstance(o, ObjectHeader) and (o.encrypted or not verified)]
        if unchecked:  # checked above every store layer; off the loop unless it is quick
            checks = [(outcomes[i], self._row(batch[i][1])) for i in unchecked]
            if len(checks) * self._row_bytes <= INLINE_CHECK_BYTES:
                opened = _open_all(checks, self.store.seal)
            else:
                opened = await anyio.to_thread.run_sync(_open_all, checks, self.store.seal)
            for i, check in zip(unchecked, opened, strict=True):
                errors[i] = check
        settle = self.row_states.settle if self.row_states is not None else None
        corrupt: list[OffloadKey] = []
        for (key, row), error in zip(batch, errors, strict=True):
            if settle is not None:  # before the outcome: a load may be waiting for this row
                settle(row, ok=error is None)
            if error is None:
                done.ok.add(key)
            elif done.block_failed(key, error):
                corrupt.append(key)
        if corrupt:
            await self._delete(done, corrupt, None)

    async def _io(self, done: JobDone, operation: Callable[..., Awaitable[list[T]]], batch: Items) -> list[Any]:
        """One store call for a batch (see `_call`); if the call itself fails, every block of
        the batch fails with its error."""
        lane = self._load_lane if isinstance(done, LoadDone) else self._store_lane
        outcome = await self._call(done, lane, operation, [(key, self._row(row)) for key, row in batch])
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

    async def _probe(self, done: ProbeDone) -> None:
        outcome = await self._call(None, self._load_lane, self.store.exists_many, done.keys)
        outcomes = [outcome] * len(done.keys) if isinstance(outcome, Exception) else outcome
        for key, found in zip(done.keys, outcomes, strict=True):
            if isinstance(found, Exception):
                done.failed("probe", found)
            elif found:
                done.found.add(key)

    async def _ping(self, done: PingDone) -> None:
        outcome = await self._call(None, self._load_lane, self.store.ping)
        if isinstance(outcome, Exception):
            done.failed("ping", outcome)

    async def _delete(self, done: Outcome, keys: list[OffloadKey], deleted: anyio.Event | None) -> None:
        try:
            outcome = await self._call(None, self._delete_lane, self.store.delete_many, keys)
            if isinstance(outcome, Exception):  # a failed delete is no sign of a sick backend; a hung one is
                done.failed("delete", outcome, sick=isinstance(outcome, HungCallError))
        finally:
            if deleted is not None:
                deleted.set()
                for key in keys:
                    if self._deleting.get(key) is deleted:
                        del self._deleting[key]

    async def _call(
        self,
        done: JobDone | None,
        lane: asyncio.Semaphore,
        operation: Callable[..., Awaitable[T]],
        *args: Any,
    ) -> T | Exception:
        """``await operation(*args)`` within its `lane`'s limit, in a task of its own so
        that the caller gets an answer within `op_timeout_s` whatever the store does: the
        result, the exception it raised, or a `HungCallError`.

        At the timeout the call is cancelled. A call that does not end at once (its thread
        is stuck in a system call, and may still write into the rows it was given) counts
        in ``done.hung`` until it returns: the job is reported with ``rows_in_use``, and a
        `RowsReleased` follows when the last such call returns.
        """
        loop = asyncio.get_running_loop()
        answered: asyncio.Future[bool] = loop.create_future()  # True: the call returned
        scope = anyio.CancelScope()
        result: list[T | Exception] = []
        late = False

        async def call() -> None:
            try:
                with scope:
                    async with lane:
                        result.append(await operation(*args))
            except Exception as exc:
                result.append(exc)
            finally:
                _answer(answered, True)
                if late and done is not None:
                    self._hung_call_returned(done)

        self._spawn(self._calls, call())
        timer = loop.call_later(self._op_timeout_s, _answer, answered, False)
        try:
            await answered
        finally:
            timer.cancel()
            returned = answered.done() and not answered.cancelled() and answered.result()
            if not returned:  # timed out, or this job was cancelled (shutdown)
                scope.cancel()
                late = True
                if done is not None:
                    done.hung += 1
        return result[0] if result else HungCallError(f"no answer in {self._op_timeout_s} s")

    def _hung_call_returned(self, done: JobDone) -> None:
        done.hung -= 1
        if done.hung == 0 and done.reported and done.rows_in_use:
            self._outbox.put(RowsReleased(job_id=done.job_id), task_finished=False)


def _answer(answered: asyncio.Future[bool], returned: bool) -> None:
    """Settle `answered` unless it is settled (or cancelled with the task awaiting it)."""
    if not answered.done():
        answered.set_result(returned)


def _open_all(checks: list[tuple[ObjectHeader, memoryview]], seal: Seal | None) -> list[CorruptObjectError | None]:
    """`open_payload` of each (header, row read into): None, or the error it raised."""
    outcomes: list[CorruptObjectError | None] = []
    for header, row in checks:
        try:
            open_payload(header, row, seal)
            outcomes.append(None)
        except CorruptObjectError as exc:
            outcomes.append(exc)
    return outcomes
