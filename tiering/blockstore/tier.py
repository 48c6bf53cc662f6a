"""`BlockStoreTier`: turns any async `BlockStore` into a `SecondaryTierManager`.

Division of labour between the two threads:

- Scheduler thread (every `SecondaryTierManager` method): the index of keys, capacity in
  bytes and LRU eviction, reader counts. Submitting a job is bookkeeping plus one
  `AsyncRuntime.submit` (a deque append); the step's jobs start at `on_schedule_end`,
  which wakes the loop once. Nothing blocks.
- Loop thread: the block operations, at most `max_concurrency` at once, each under a
  timeout. A job's task records which blocks succeeded and puts the job in the outbox;
  `get_finished` applies those outcomes to the index. The index is never touched from the
  loop, so no lock guards it.

Rules: a key is in flight (lookup None) from `submit_store` until its job is reported; a
block being read is never evicted; an evicted key's delete finishes before a new put of the
same key starts; a load that finds a missing or corrupt object drops the key (and deletes the
object); a job succeeds only if all its blocks do; every job is reported exactly once, also
when the tier shuts down with it in flight (as failed).
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.to_thread
import numpy as np

from tiering.errors import CorruptObjectError, ObjectNotFoundError, UnusableObjectError
from tiering.health import TierHealth
from tiering.keys import OffloadKey, ReqContext
from tiering.object_format import ObjectHeader, layout_fingerprint, object_size, verify_payload
from tiering.runtime import AsyncRuntime, RuntimeClosedError
from tiering.secondary import JobMetadata, JobResult, SecondaryTierManager
from tiering.stats import Histogram, TierStats

if TYPE_CHECKING:
    from tiering.blockstore import BlockStore

logger = logging.getLogger(__name__)

T = TypeVar("T")
_ROOM_BACKOFF_S = (1.0, 30.0)  # first and longest wait before a full device is tried again

_COUNTERS = (
    "blocks_stored",
    "bytes_stored",
    "blocks_loaded",
    "bytes_loaded",
    "evictions",
    "jobs_succeeded",
    "jobs_failed",
)


class _Entry:
    __slots__ = ("readers", "size", "stored")

    def __init__(self, size: int, stored: bool = False):
        self.size = size
        self.stored = stored
        self.readers = 0


@dataclass
class _Done:
    """An operation's outcome, filled on the loop thread, applied on the scheduler thread.

    `kind` is "store" or "load" (a job, reported), "probe" (an existence check of `keys[0]`,
    found if in `ok`), "ping" (a health probe), or "released" (the store calls of job
    `job_id` that had timed out have all returned: its primary rows may be reused).
    """

    kind: str
    job_id: int | None
    keys: list[OffloadKey]
    complete: bool = True  # False if some block was refused before any I/O, or the job broke
    ok: set[OffloadKey] = field(default_factory=set)
    drop: set[OffloadKey] = field(default_factory=set)
    errors: int = 0  # failures that say the backend is sick, counted by the health breaker
    no_space: int = 0  # stores refused by a full device (not a sign of a sick backend)
    hung: int = 0  # store calls that timed out and have not returned (loop thread only)
    rows_in_use: bool = False  # set when reported: a timed-out call may still touch the rows
    reported: bool = False

    @property
    def success(self) -> bool:
        return self.complete and len(self.ok) == len(self.keys)


class BlockStoreTier(SecondaryTierManager):
    """A secondary tier over a `BlockStore`, its I/O on an `AsyncRuntime` loop.

    The runtime is the spec's ``async_runtime`` attribute when it has one (one loop per
    engine), else a private one. Object namespace: the spec's ``layout_fingerprint``
    attribute (16 bytes) when it has one, else a fingerprint of the primary row size.
    """

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        store_factory: Callable[[bytes], BlockStore],
        capacity_bytes: int | None = None,
        max_concurrency: int = 64,
        op_timeout_s: float = 30.0,
        open_timeout_s: float = 120.0,
        shutdown_timeout_s: float = 30.0,
        batch_bytes: int = 4 << 20,
        probe_misses: bool = False,
        negative_ttl_s: float = 5.0,
        failure_threshold: int = 5,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
    ):
        """Open the store and rebuild the index from what it holds (blocks the caller).

        Args:
            store_factory: builds the store from the layout fingerprint.
            capacity_bytes: object bytes held at most, or None for no limit.
            max_concurrency: store operations (a block or a batch) in flight at once.
            op_timeout_s: seconds one store operation may take before it fails.
            open_timeout_s: seconds opening and recovering may take.
            shutdown_timeout_s: seconds `shutdown` waits for jobs in flight.
            batch_bytes: a job's blocks reach the store (`put_many`/`get_many`) in batches
                of about this many bytes, amortising the per-operation cost of small blocks.
            probe_misses: a lookup of a key not in the index asks the store whether it
                exists (once per key at a time; None until the answer), for stores that
                other engines write to (a shared bucket or directory).
            negative_ttl_s: how long a probe's "absent" is believed, seconds.
            failure_threshold, backoff_s, max_backoff_s: the health breaker (`TierHealth`).

        Raises:
            ValueError: an option is out of range, or `capacity_bytes` cannot hold one block.
            OSError, TimeoutError: the store could not be opened or recovered in time.
        """
        if capacity_bytes is not None and capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        if max_concurrency < 1 or op_timeout_s <= 0:
            raise ValueError(
                f"max_concurrency must be >= 1 and op_timeout_s > 0, got {max_concurrency}, {op_timeout_s}"
            )
        super().__init__(offloading_spec, primary_kv_view, tier_type)
        self._rows = np.asarray(primary_kv_view).view(np.uint8)
        self.row_bytes = self._rows.shape[1]
        self.fingerprint = getattr(offloading_spec, "layout_fingerprint", None) or layout_fingerprint(
            f"row_bytes={self.row_bytes}"
        )
        self.store = store_factory(self.fingerprint)
        smallest = object_size(0, self.row_bytes, self.store.header_align)
        if capacity_bytes is not None and capacity_bytes < smallest:
            raise ValueError(
                f"capacity_bytes ({capacity_bytes}) cannot hold one block: a block takes at least {smallest} bytes "
                f"(a row of {self.row_bytes} and its header)"
            )
        self.capacity_bytes = capacity_bytes
        self.room_bytes: int | None = None  # while the device is full: what it was found to hold
        self._room_retry_at = 0.0
        self._room_backoff_s = _ROOM_BACKOFF_S[0]
        self.used_bytes = 0
        self.op_timeout_s = op_timeout_s
        self.failures: Counter[str] = Counter()
        self._counters: Counter[str] = Counter()  # blocks and bytes stored and loaded, evictions, jobs
        self._lookups: dict[bool | None, int] = {True: 0, False: 0, None: 0}
        self._job_started: dict[int, float] = {}
        self._job_seconds = Histogram()
        self._limiter = anyio.CapacityLimiter(max_concurrency)
        self.health = TierHealth(tier_type, failure_threshold, backoff_s, max_backoff_s)
        self._probe_misses = probe_misses
        self._negative_ttl_s = negative_ttl_s
        self._probes: dict[OffloadKey, float | None] = {}  # None: in flight; else absent until
        self._batch_blocks = max(1, batch_bytes // max(1, self.row_bytes))
        self._shutdown_timeout_s = shutdown_timeout_s
        self._index: OrderedDict[OffloadKey, _Entry] = OrderedDict()
        self._object_bytes: dict[int, int] = {}  # by key length
        self._outbox: deque[_Done] = deque()
        self._released: list[int] = []
        self._done_cv = threading.Condition()
        self._tasks_submitted = 0
        self._tasks_done = 0
        self._closed = False
        self._task_group: anyio.abc.TaskGroup | None = None
        self._deleting: dict[OffloadKey, anyio.Event] = {}
        runtime = getattr(offloading_spec, "async_runtime", None) or AsyncRuntime(f"tiering-{tier_type}")
        self._runtime = runtime.acquire()
        try:
            recovered = self._runtime.run_sync(self._open, timeout_s=open_timeout_s)
        except BaseException as exc:
            self._closed = True
            self._runtime.release()
            if isinstance(exc, TimeoutError):
                raise TimeoutError(f"tier {tier_type}: {self.store!r} did not open in {open_timeout_s} s") from None
            raise
        self._adopt(recovered)

    # -- SecondaryTierManager (scheduler thread) -------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        """True if stored here, None while its store (or an existence probe) is in flight,
        else False. Always False while the tier is unhealthy."""
        entry = self._index.get(key)
        answer: bool | None
        if not self.health.healthy:
            answer = False
        elif entry is not None:
            answer = True if entry.stored else None
        else:
            answer = self._probe(key) if self._probe_misses else False
        self._lookups[answer] += 1
        return answer

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Make the held `keys` the most recent for eviction (the first one most)."""
        index = self._index
        for key in reversed(list(keys)):
            if key in index:
                index.move_to_end(key)

    def submit_store(self, job_metadata: JobMetadata) -> None:
        """Reserve room for the blocks not held yet (evicting idle LRU blocks) and start
        writing them. A block that finds no room fails the job, the others still go."""
        self._job_started[job_metadata.job_id] = time.perf_counter()
        done = _Done("store", job_metadata.job_id, [])
        items: list[tuple[OffloadKey, int]] = []
        evicted: list[OffloadKey] = []
        refuse = self._closed or not self.health.healthy
        for key, block_id in zip(job_metadata.keys, job_metadata.block_ids, strict=True):
            if key in self._index:
                continue
            size = self.object_bytes(key)
            if refuse or not self._make_room(size, evicted):
                done.complete = False
                continue
            self._index[key] = _Entry(size)
            self.used_bytes += size
            self._probes.pop(key, None)
            items.append((key, int(block_id)))
        done.keys = [key for key, _ in items]
        if evicted:
            self._submit_task(None, partial(self._delete_job, evicted))
        if items:
            self._submit_task(done, partial(self._store_job, done, items))
        else:
            self._outbox.append(done)

    def submit_load(self, job_metadata: JobMetadata) -> None:
        """Start reading the job's blocks into its primary rows; fails at once if a key is
        not stored here."""
        self._job_started[job_metadata.job_id] = time.perf_counter()
        items = list(zip(job_metadata.keys, (int(b) for b in job_metadata.block_ids), strict=True))
        done = _Done("load", job_metadata.job_id, [key for key, _ in items])
        entries = [self._index.get(key) for key, _ in items]
        refuse = self._closed or not self.health.healthy
        held = [entry for entry in entries if entry is not None and entry.stored]
        if refuse or len(held) != len(entries):
            done.keys = []
            done.complete = False
            self._outbox.append(done)
            return
        for entry in held:
            entry.readers += 1
        self._submit_task(done, lambda: partial(self._in_batches, self._load_batch, done, items))

    def get_finished(self) -> list[JobResult]:
        """Results of the jobs finished since the last call; applies their outcomes to the
        index. Never blocks."""
        outbox = self._outbox
        results = []
        while outbox:
            done = outbox.popleft()
            if done.kind == "ping":
                self.health.probe_result(done.success)
                continue
            if done.kind == "released":
                if done.job_id is not None:
                    self._released.append(done.job_id)
                continue
            self.health.record(len(done.ok), done.errors)
            if done.kind == "store":
                self._apply_store(done)
            elif done.kind == "load":
                self._apply_load(done)
            else:
                self._apply_probe(done)
            if done.job_id is not None:
                results.append(JobResult(done.job_id, done.success, rows_in_use=done.rows_in_use))
                self._counters["jobs_succeeded" if done.success else "jobs_failed"] += 1
                started = self._job_started.pop(done.job_id, None)
                if started is not None:
                    self._job_seconds.observe(time.perf_counter() - started)
        return results

    def take_released_jobs(self) -> list[int]:
        """Jobs reported with ``rows_in_use`` whose late store calls have returned since the
        last call (their rows may be reused now). Scheduler thread, after `get_finished`;
        never blocks."""
        released, self._released = self._released, []
        return released

    def get_stats(self) -> TierStats:
        """Counters (lookups by answer, blocks and bytes stored and loaded, evictions, jobs
        succeeded and failed, failures by reason), gauges (blocks and bytes held, capacity,
        jobs in flight, health) and the job-duration histogram. Cheap; scheduler thread."""
        counters = {
            "lookups": sum(self._lookups.values()),
            "hits": self._lookups[True],
            "misses": self._lookups[False],
            "lookups_in_flight": self._lookups[None],
            **{name: self._counters[name] for name in _COUNTERS},
            "failures": dict(self.failures),
        }
        gauges = {
            "blocks": len(self._index),
            "bytes": self.used_bytes,
            "capacity_bytes": self.capacity_bytes,
            "room_bytes": self.room_bytes,
            "jobs_in_flight": len(self._job_started),
            "healthy": self.health.healthy,
            "state": self.health.state.value,
        }
        return {"counters": counters, "gauges": gauges, "job_seconds": self._job_seconds.snapshot()}

    def on_schedule_end(self) -> None:
        """Start the work submitted during the step (one wake-up of the loop), and, when an
        unhealthy tier's backoff has passed, its health probe. Nothing after shutdown."""
        if self._closed:
            return
        if not self.health.healthy and self.health.probe_due():
            done = _Done("ping", None, [])
            self._submit_task(done, lambda: partial(self._ping, done))
        self._runtime.flush()

    def has_pending_work(self) -> bool:
        return self._tasks_done != self._tasks_submitted or bool(self._outbox)

    def drain(self, timeout_s: float | None = None) -> bool:
        """Block until every submitted operation finished (results may wait in the outbox).

        Raises:
            RuntimeError: called from the loop thread.
        """
        if self._runtime.in_loop_thread():
            raise RuntimeError(f"tier {self.tier_type}: drain() from the loop thread would deadlock")
        if not self._closed:  # after shutdown nothing new can start; only wait
            self._runtime.flush()
        with self._done_cv:
            return self._done_cv.wait_for(lambda: self._tasks_done == self._tasks_submitted, timeout_s)

    def shutdown(self) -> None:
        """Cancel jobs in flight (each is reported as failed), close the store, release the
        runtime. Returns within ``shutdown_timeout_s`` seconds, also while a thread is stuck
        in a system call (it is left behind, logged). Later calls do nothing."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + self._shutdown_timeout_s
        try:
            self._runtime.flush()  # queued jobs reach the loop first, to be reported as failed
            self._runtime.run_sync(self._stop, timeout_s=self._shutdown_timeout_s)
        except TimeoutError:
            logger.warning("tier %s: I/O still running %.1f s into shutdown", self.tier_type, self._shutdown_timeout_s)
        except RuntimeClosedError:
            logger.warning("tier %s: its runtime was shut down before the tier", self.tier_type)
        finally:
            self._runtime.release(timeout_s=max(0.1, deadline - time.monotonic()))

    def object_bytes(self, key: OffloadKey) -> int:
        """Bytes the stored object of `key` takes (header and payload), counted in capacity."""
        size = self._object_bytes.get(len(key))
        if size is None:
            size = self._object_bytes[len(key)] = object_size(len(key), self.row_bytes, self.store.header_align)
        return size

    @property
    def num_blocks(self) -> int:
        """Keys held or being stored."""
        return len(self._index)

    # -- scheduler-thread internals --------------------------------------------------------

    def _adopt(self, recovered: list[tuple[OffloadKey, int]]) -> None:
        for key, size in recovered:
            self._add_stored(key, size)
        self._runtime.flush()
        logger.info("tier %s: recovered %d blocks (%d bytes)", self.tier_type, len(self._index), self.used_bytes)

    def _limit(self) -> int | None:
        """Bytes the tier may hold now: its capacity, or less while the device is full. The
        full device's room is forgotten at ``_room_retry_at``, so the tier learns again,
        from the next store's outcome, how much the device holds (space may have come back)."""
        if self.room_bytes is not None and time.monotonic() >= self._room_retry_at:
            logger.info(
                "tier %s: retrying stores beyond the %d bytes a full device held", self.tier_type, self.room_bytes
            )
            self.room_bytes = None
        if self.room_bytes is None or (self.capacity_bytes is not None and self.capacity_bytes < self.room_bytes):
            return self.capacity_bytes
        return self.room_bytes

    def _make_room(self, size: int, evicted: list[OffloadKey]) -> bool:
        capacity = self._limit()
        if capacity is None:
            return True
        if size > capacity:
            return False
        index = self._index
        while self.used_bytes + size > capacity:
            victim = next((key for key, entry in index.items() if entry.stored and entry.readers == 0), None)
            if victim is None:
                return False
            self.used_bytes -= index.pop(victim).size
            evicted.append(victim)
            self._counters["evictions"] += 1
        return True

    def _apply_store(self, done: _Done) -> None:
        for key in done.keys:
            entry = self._index.get(key)
            if entry is None:
                continue
            if key in done.ok:
                entry.stored = True
                self._counters["blocks_stored"] += 1
                self._counters["bytes_stored"] += entry.size
            else:
                del self._index[key]
                self.used_bytes -= entry.size
        if done.no_space:
            if self.room_bytes is None:  # full again after a retry: wait longer before the next
                backoff = self._room_backoff_s
                self._room_backoff_s = min(backoff * 2, _ROOM_BACKOFF_S[1])
                logger.warning(
                    "tier %s: device full at %d bytes; holding at most that, retrying in %.0f s",
                    self.tier_type,
                    self.used_bytes,
                    backoff,
                )
                self._room_retry_at = time.monotonic() + backoff
            self.room_bytes = self.used_bytes
        elif done.ok and self.room_bytes is None:
            self._room_backoff_s = _ROOM_BACKOFF_S[0]

    def _probe(self, key: OffloadKey) -> bool | None:
        state = self._probes.get(key, 0.0)
        if state is None:
            return None
        if state > time.monotonic():
            return False
        if len(self._probes) >= 65536:
            now = time.monotonic()
            self._probes = {k: v for k, v in self._probes.items() if v is None or v > now}
        self._probes[key] = None
        done = _Done("probe", None, [key])
        self._submit_task(done, lambda: partial(self._exists, done, key))
        return None

    def _apply_probe(self, done: _Done) -> None:
        key = done.keys[0]
        if key not in done.ok:
            self._probes[key] = time.monotonic() + self._negative_ttl_s
            return
        self._probes.pop(key, None)
        if key not in self._index:
            self._add_stored(key, self.object_bytes(key))

    def _add_stored(self, key: OffloadKey, size: int) -> None:
        """Index an object that already exists (recovered or found by a probe) as the most
        recent, evicting the least recent ones if the tier is now over capacity."""
        self._index[key] = _Entry(size, stored=True)
        self.used_bytes += size
        evicted: list[OffloadKey] = []
        self._make_room(0, evicted)
        if evicted:
            self._submit_task(None, partial(self._delete_job, evicted))

    def _apply_load(self, done: _Done) -> None:
        index = self._index
        for key in done.keys:
            entry = index.get(key)
            if entry is None:
                continue
            entry.readers -= 1
            if key in done.drop:
                del index[key]
                self.used_bytes -= entry.size
            elif key in done.ok:
                index.move_to_end(key)
                self._counters["blocks_loaded"] += 1
                self._counters["bytes_loaded"] += entry.size

    def _submit_task(self, done: _Done | None, make_job: Callable[[], Callable[[], Awaitable[None]]]) -> None:
        """Hand a job to the loop thread, where ``make_job()`` builds it (see `_start`)."""
        self._tasks_submitted += 1
        self._runtime.submit(partial(self._start, done, make_job))

    # -- loop thread -----------------------------------------------------------------------

    async def _open(self) -> list[tuple[OffloadKey, int]]:
        await self.store.open()
        try:
            recovered = await self.store.recover()
            self._stop_event, self._stopped = anyio.Event(), anyio.Event()
            await self._runtime.task_group.start(self._serve)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.store.close()
            raise
        return recovered

    async def _serve(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        try:
            async with anyio.create_task_group() as task_group:
                self._task_group = task_group
                task_status.started()
                await self._stop_event.wait()
                task_group.cancel_scope.cancel()
        finally:
            self._task_group = None
            with anyio.CancelScope(shield=True):
                await self.store.close()
                self._stopped.set()

    async def _stop(self) -> None:
        self._stop_event.set()
        await self._stopped.wait()

    def _start(self, done: _Done | None, make_job: Callable[[], Callable[[], Awaitable[None]]]) -> None:
        """Start ``make_job()`` in the tier's task group. If the tier is stopped, or anything
        raises while starting, the job fails and is reported at once: never lost."""
        try:
            if self._task_group is None:
                raise RuntimeClosedError(f"tier {self.tier_type} is shut down")
            self._task_group.start_soon(self._run_task, done, make_job())
        except Exception as exc:
            if self._task_group is not None:
                self._failed("start", exc)
            if done is not None:
                done.complete = False
            self._finish_task(done)

    async def _run_task(self, done: _Done | None, job: Callable[[], Awaitable[None]]) -> None:
        try:
            await job()
        except Exception as exc:  # a bug here or in a store: this job fails, the tier goes on
            self._failed("internal", exc)
            if done is not None:
                done.complete = False
        finally:
            self._finish_task(done)

    def _finish_task(self, done: _Done | None) -> None:
        with self._done_cv:
            if done is not None:
                done.rows_in_use, done.reported = done.hung > 0, True
                self._outbox.append(done)
            self._tasks_done += 1
            self._done_cv.notify_all()

    def _store_job(self, done: _Done, items: list[tuple[OffloadKey, int]]) -> Callable[[], Awaitable[None]]:
        waits = [self._deleting[key] for key, _ in items if key in self._deleting]
        return partial(self._store_blocks, done, items, waits)

    def _delete_job(self, keys: list[OffloadKey]) -> Callable[[], Awaitable[None]]:
        deleted = anyio.Event()
        self._deleting.update(dict.fromkeys(keys, deleted))
        return partial(self._delete_blocks, keys, deleted)

    async def _store_blocks(self, done: _Done, items: list[tuple[OffloadKey, int]], waits: list[anyio.Event]) -> None:
        for deleted in waits:
            await deleted.wait()
        await self._in_batches(self._store_batch, done, items)

    async def _in_batches(self, run_batch, done: _Done, items: list[tuple[OffloadKey, int]]) -> None:
        size = self._batch_blocks
        if len(items) <= size:
            await run_batch(done, items)
            return
        async with anyio.create_task_group() as task_group:
            for start in range(0, len(items), size):
                task_group.start_soon(run_batch, done, items[start : start + size])

    async def _store_batch(self, done: _Done, batch: list[tuple[OffloadKey, int]]) -> None:
        for (key, _), error in zip(batch, await self._io(done, self.store.put_many, batch), strict=True):
            if error is None:
                done.ok.add(key)
            elif isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
                self._failed("store_no_space", error)
                done.no_space += 1
            else:
                self._failed("store", error)
                done.errors += 1

    async def _load_batch(self, done: _Done, batch: list[tuple[OffloadKey, int]]) -> None:
        outcomes = await self._io(done, self.store.get_many, batch)
        read = [i for i, outcome in enumerate(outcomes) if isinstance(outcome, ObjectHeader)]
        if read:  # the CRC, checked above every store layer, off the loop thread
            checks = [(outcomes[i], memoryview(self._rows[batch[i][1]])) for i in read]
            for i, error in zip(read, await anyio.to_thread.run_sync(_verify_all, checks), strict=True):
                outcomes[i] = error
        corrupt = []
        for (key, _), error in zip(batch, outcomes, strict=True):
            if error is None:
                done.ok.add(key)
            elif isinstance(error, ObjectNotFoundError):
                self._failed("load_missing", error)
                done.drop.add(key)
            elif isinstance(error, CorruptObjectError):  # or unusable: dropped, and no sign of a sick backend
                self._failed("load_unusable" if isinstance(error, UnusableObjectError) else "load_corrupt", error)
                done.drop.add(key)
                corrupt.append(key)
            else:
                self._failed("load", error)
                done.errors += 1
        if corrupt:
            await self._delete_blocks(corrupt, None)

    async def _io(self, done: _Done, operation, batch: list[tuple[OffloadKey, int]]) -> list[Any]:
        """One store call for a batch (see `_call`); if the call itself fails, every block of
        the batch fails with its error."""
        outcome = await self._call(done, operation, [(key, memoryview(self._rows[row])) for key, row in batch])
        if isinstance(outcome, Exception):
            return [outcome] * len(batch)
        if len(outcome) != len(batch):
            raise RuntimeError(f"{type(self.store).__name__}: {len(outcome)} outcomes for {len(batch)} blocks")
        return outcome

    async def _call(self, done: _Done | None, operation: Callable[..., Awaitable[T]], *args: Any) -> T | Exception:
        """``await operation(*args)`` under the concurrency limit, in a task of its own so
        that the caller gets an answer within `op_timeout_s` whatever the store does: the
        result, the exception it raised, or a `TimeoutError`.

        At the timeout the call is cancelled. A call that does not end at once (its thread
        is stuck in a system call, and may still write into the rows it was given) counts
        in ``done.hung`` until it returns: the job is reported with ``rows_in_use``, and
        released when the last such call returns.
        """
        finished, scope = anyio.Event(), anyio.CancelScope()
        result: list[T | Exception] = []

        async def call() -> None:
            try:
                with scope:
                    async with self._limiter:
                        result.append(await operation(*args))
            except Exception as exc:
                result.append(exc)
            finally:
                finished.set()
                if late and done is not None:
                    self._hung_call_returned(done)

        late = False
        assert self._task_group is not None, "store calls run only while the tier serves"
        self._task_group.start_soon(call)
        try:
            with anyio.move_on_after(self.op_timeout_s):
                await finished.wait()
        finally:
            if not finished.is_set():  # timed out, or this job was cancelled (shutdown)
                scope.cancel()
                late = True
                if done is not None:
                    done.hung += 1
        return result[0] if result else TimeoutError(f"no answer in {self.op_timeout_s} s")

    def _hung_call_returned(self, done: _Done) -> None:
        done.hung -= 1
        if done.hung == 0 and done.reported and done.rows_in_use:
            with self._done_cv:
                self._outbox.append(_Done("released", done.job_id, done.keys))

    async def _exists(self, done: _Done, key: OffloadKey) -> None:
        outcome = await self._call(done, self.store.exists, key)
        if isinstance(outcome, Exception):
            self._failed("probe", outcome)
            done.errors += 1
        elif outcome:
            done.ok.add(key)

    async def _ping(self, done: _Done) -> None:
        outcome = await self._call(done, self.store.ping)
        if isinstance(outcome, Exception):
            self._failed("ping", outcome)
            done.errors += 1
            done.complete = False

    async def _delete_blocks(self, keys: list[OffloadKey], deleted: anyio.Event | None) -> None:
        try:
            outcome = await self._call(None, self.store.delete_many, keys)
            if isinstance(outcome, Exception):
                self._failed("delete", outcome)
        finally:
            if deleted is not None:
                deleted.set()
                for key in keys:
                    if self._deleting.get(key) is deleted:
                        del self._deleting[key]

    def _failed(self, reason: str, exc: BaseException) -> None:
        count = self.failures[reason] = self.failures[reason] + 1
        if count & (count - 1) == 0:  # 1, 2, 4, 8, ...: a trace of every reason, never a flood
            logger.warning("tier %s: %s failed (%d so far): %r", self.tier_type, reason, count, exc)


def _verify_all(checks: list[tuple[ObjectHeader, memoryview]]) -> list[CorruptObjectError | None]:
    """`verify_payload` of each (header, row read into): None, or the error it raised."""
    outcomes: list[CorruptObjectError | None] = []
    for header, row in checks:
        try:
            verify_payload(header, row)
            outcomes.append(None)
        except CorruptObjectError as exc:
            outcomes.append(exc)
    return outcomes
