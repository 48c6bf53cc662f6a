"""`BlockStoreTier`: turns any async `BlockStore` into a `SecondaryTierManager`.

Scheduler thread: every method here. It keeps the `BlockIndex` (keys, capacity, LRU
eviction, readers), the health breaker and the stats; submitting a job is bookkeeping plus
one `AsyncRuntime.submit` (a deque append), and the step's jobs start at `on_schedule_end`,
which wakes the loop once. Nothing blocks except `drain` and `shutdown`. The loop half is
`tiering.tiers.blockstore.worker.BlockWorker`; they meet in the `Outbox` only. What the store
held at start is recovered while the tier serves (`tiering.tiers.blockstore.recovery`).

Deletes of evicted objects are deferred to the end of the step and sent as one batch; a key
evicted and stored again within the step is not deleted at all (the put replaces the
object). Rules: a key is in flight (lookup None) from `submit_store` until its job is
reported; a block being read is never evicted; a load that finds a missing, corrupt or forged
object drops the key (a forged one is also believed absent for `negative_ttl_s`, so probes do
not find it again at once); a job succeeds only if all its blocks do; every job is reported
exactly once, also when the tier shuts down with it in flight (as failed), or resets.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Coroutine
from functools import partial
from typing import Any

import numpy as np

from tiering.contract.keys import OffloadKey, ReqContext
from tiering.contract.mediums import OffloadingEvent
from tiering.cpu.row_states import RowStates
from tiering.errors import HungCallError, RuntimeClosedError, describe
from tiering.stats import TierStats
from tiering.tiers.base import Doorbell, JobMetadata, JobResult, SecondaryTierManager
from tiering.tiers.blockstore import outbox
from tiering.tiers.blockstore.applying import apply_load, apply_store
from tiering.tiers.blockstore.counters import TierCounters
from tiering.tiers.blockstore.existence import ExistenceChecks
from tiering.tiers.blockstore.generations import Records
from tiering.tiers.blockstore.health import TierHealth
from tiering.tiers.blockstore.index import BlockIndex
from tiering.tiers.blockstore.opening import new_index, open_worker, store_maker
from tiering.tiers.blockstore.outbox import LoadDone, Outbox, Outcome, StoreDone
from tiering.tiers.blockstore.recovery import START_WAIT_S, Recovery
from tiering.tiers.blockstore.settings import BlockStoreSettings
from tiering.tiers.blockstore.store import BlockStore
from tiering.tiers.blockstore.worker import BlockWorker
from tiering.tiers.events import TierEvents
from tiering.tiers.object_format import object_size
from tiering.tiers.runtime import AsyncRuntime

logger = logging.getLogger(__name__)


class BlockStoreTier(SecondaryTierManager):
    """A secondary tier over a `BlockStore`, its I/O on an `AsyncRuntime` loop.

    The loop is the context's shared runtime when it has one (one loop per engine), else a
    private one. Objects live in the namespace of the engine's identity (the context's
    layout fingerprint) and the tier's generation (`tiering.tiers.blockstore.generations`).

    Attributes:
        store: the block store of the current generation.
        settings: the `BlockStoreSettings` it runs under.
        failures: failed store calls by reason (``store``, ``load_corrupt``, ...).
        health: the `TierHealth` breaker.
    """

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        store_factory: Callable[[bytes], BlockStore],
        settings: BlockStoreSettings | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        """Open the store (blocks the caller) and start recovering what it holds, while it serves.

        Args:
            offloading_spec, primary_kv_view, tier_type: as for every `SecondaryTierManager`.
            store_factory: builds a store of a 16-byte namespace.
            settings: capacity, concurrency, timeouts, batching, probing and health (see
                `BlockStoreSettings`); None takes the defaults.
            clock: seconds, monotonic: for the negative probe cache, the health breaker's
                backoff and the index's full-device retries (tests pass their own).

        Raises:
            ValueError: `capacity_bytes` cannot hold one block; `integrity` is set and the store
                does not support it, or its keys cannot be read (`tiering.tiers.seal.read_keys`).
            OSError, TimeoutError: the store could not be opened in time.
            TieringError: the store's own errors while opening.
        """
        super().__init__(offloading_spec, primary_kv_view, tier_type)
        self.settings = settings = settings or BlockStoreSettings()
        rows = np.asarray(self.context.primary_rows).view(np.uint8)
        self.row_bytes = rows.shape[1]
        make_store = store_maker(self.name, store_factory, settings, self.row_bytes)
        context = self.context
        self._records = Records(make_store, context.layout_fingerprint, context.manifest, context.weight_version)
        self._epoch = 0  # bumped by each new generation: outcomes of an older one leave the index alone
        self._counters = TierCounters(self.name)
        self.failures = self._counters.failures
        self._clock = clock
        self.health = TierHealth(
            self.name, settings.failure_threshold, settings.backoff_s, settings.max_backoff_s, clock=clock
        )
        self._outbox = Outbox()
        self._existence = ExistenceChecks(settings.negative_ttl_s, clock)
        self._object_bytes: dict[int, int] = {}  # by key length
        self._released: list[int] = []
        self._evicted: dict[OffloadKey, None] = {}  # objects to delete at the end of the step
        self._closed = False
        self._batch_blocks = batch_blocks = max(1, settings.batch_bytes // max(1, self.row_bytes))
        runtime = self.context.runtime or AsyncRuntime(f"tiering-{self.name}")
        self._runtime = runtime.acquire()
        self._worker = BlockWorker(self.name, self._records, rows, self._outbox, settings, batch_blocks, self._runtime)
        self.locality, self.lasting = self.store.locality, self.store.lasting  # every generation's: one config
        self._new_index = partial(new_index, self.name, settings, self.row_bytes, self.store.header_align, clock)
        self._index = self._new_index()
        self._recovery: Recovery | None = None
        self._open()

    @property
    def store(self) -> BlockStore:
        """The block store of the current generation (the loop thread replaces it)."""
        return self._worker.store

    def new_generation(self, weight_version: str | None = None) -> None:
        """`reset_cache`: forget every block; on the loop, move to the namespace of the
        weights `weight_version` (None: a namespace of this engine's own; see
        `tiering.tiers.blockstore.generations`; `BlockWorker.start_switch`). Jobs in flight are
        still reported; their outcomes no longer touch the index. Never blocks; nothing after
        shutdown."""
        if self._closed:
            return
        self._recovery = None  # what the old generation held is moot
        self._epoch += 1
        self._index = self._index.replaced_by(self._new_index())
        self._existence = ExistenceChecks(self.settings.negative_ttl_s, self._clock)
        self._evicted.clear()  # their namespace goes as a whole
        open_next = partial(self._records.open_next, weight_version, self.settings.open_timeout_s)
        self._runtime.submit(partial(self._worker.start_switch, open_next))  # at the step's end

    def _open(self) -> None:
        """Open the store (`open_worker`; on failure the tier is closed) and list what it
        holds (`tiering.tiers.blockstore.recovery`: indexed here if it lists within
        `START_WAIT_S`, else while the tier serves).

        Raises:
            OSError, TimeoutError, TieringError: as `__init__`.
        """
        try:
            open_worker(self.name, self._worker, self._runtime, self.settings.open_timeout_s)
        except BaseException:
            self._closed = True
            raise
        self._recovery = Recovery(self.name, lambda keys: self._evicted.update(dict.fromkeys(keys)))
        self._submit(self._worker.start_recover, self._recovery.done, self.settings.open_timeout_s)
        self.wait_recovered(START_WAIT_S)  # a small tier is warm at its first lookup; a large one lists on

    def wait_recovered(self, timeout_s: float | None = None) -> bool:
        """Block until every block the store held is indexed (or `timeout_s` seconds pass;
        None: no limit); returns whether it is. The scheduler thread, for tools and tests,
        never from inside a step. Raises RuntimeError from the loop thread (as `drain`)."""
        if self._recovery is not None and self.drain(timeout_s):
            self._index_recovered(everything=True)
        return self._recovery is None

    def _index_recovered(self, everything: bool = False) -> None:
        if self._recovery is not None and self._recovery.index_next(self._index, self._outbox.doorbell, everything):
            self._recovery = None

    # -- SecondaryTierManager ---------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        """True if stored here, None while its store (or an existence probe) is in flight,
        else False. Always False while the tier is unhealthy or its loop thread is dead."""
        entry = self._index.get(key)
        answer: bool | None
        if not self._serving:
            answer = False
        elif entry is not None:
            answer = True if entry.stored else None
        else:
            answer = self._existence.lookup(key) if self.settings.probe_misses else False
        self._counters.lookups[answer] += 1
        return answer

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Make the held `keys` the most recent for eviction (the first one most)."""
        self._index.touch(keys)

    def retain(self, keys: Collection[OffloadKey], seconds: float) -> list[OffloadKey]:
        """A request's hint: the held `keys` get a deadline `seconds` from now, or keep a
        later one (`tiering.eviction.retention`); returns the keys this tier does not hold (nor is
        storing). Scheduler thread."""
        return self._index.retain(keys, seconds)

    def release(self, keys: Collection[OffloadKey]) -> None:
        """A request's hint: the held `keys` lose their deadlines and are evicted first
        (`tiering.eviction.retention`). Scheduler thread."""
        self._index.release(keys)

    def submit_store(self, job_metadata: JobMetadata) -> None:
        """Reserve room for the blocks not held yet (evicting idle LRU blocks) and start
        writing them. A block that finds no room fails the job, the others still go."""
        self._counters.stores.start(job_metadata.job_id)
        done = StoreDone(job_id=job_metadata.job_id, wants_local=self._index.events is not None)
        evicted: list[OffloadKey] = []
        items: list[tuple[OffloadKey, int]]
        jobs_items = zip(job_metadata.keys, job_metadata.block_ids.tolist(), strict=True)
        if self._closed or not self._serving:
            items, done.complete = [], all(key in self._index for key in job_metadata.keys)
        else:
            items, done.complete = self._index.reserve_all(jobs_items, self.object_bytes, evicted)
        done.keys = [key for key, _ in items]
        self._existence.forget(done.keys)  # a check's answer is moot once the key is stored
        if self._evicted:  # and so is a deferred delete
            for key in done.keys:
                self._evicted.pop(key, None)
        self._evicted.update(dict.fromkeys(evicted))
        if items:
            # a full device: its room is there once the evicted objects are gone, so they are
            # deleted now (not at the end of the step) and the store writes after that
            full = self._index.room_bytes is not None
            if full:
                self._flush_deletes()
            self._submit(self._worker.start_store, done, items, full)
        else:
            self._outbox.put(done, task_finished=False)

    def submit_load(self, job_metadata: JobMetadata) -> None:
        """Start reading the job's blocks into its primary rows; fails at once if a key is
        not stored here."""
        self._counters.loads.start(job_metadata.job_id)
        items = list(zip(job_metadata.keys, (int(b) for b in job_metadata.block_ids), strict=True))
        keys = [key for key, _ in items]
        if self._closed or not self._serving or not self._index.start_reads(keys):
            if self._worker.row_states is not None:  # now: a load may be waiting for these rows
                for _, row in items:
                    self._worker.row_states.settle(row, ok=False)
            self._outbox.put(LoadDone(job_id=job_metadata.job_id, complete=False), task_finished=False)
            return
        self._submit(self._worker.start_load, LoadDone(job_id=job_metadata.job_id, keys=keys), items)

    def get_finished(self) -> list[JobResult]:
        """Results of the jobs finished since the last call; applies their outcomes to the
        index. Never blocks."""
        results = []
        self._index_recovered()
        for outcome in self._outbox.take():
            current = outcome.epoch == self._epoch  # else of a generation before a reset: not in the index
            self._counters.failed(outcome)
            if self.health.healthy and any(isinstance(error, HungCallError) for _, error in outcome.failures):
                # calls stop returning: no more work for the tier (each would strand a thread)
                self.health.trip(f"a call gave no answer in {self.settings.op_timeout_s} s")
            match outcome:
                case outbox.PingDone():
                    self.health.ping_result(not outcome.errors)
                case outbox.RowsReleased():
                    self._released.append(outcome.job_id)
                case outbox.DeletesDone():
                    if current:
                        self._index.deleted(outcome.keys)
                case outbox.ProbeDone():
                    self.health.record(len(outcome.keys) - outcome.errors, outcome.errors)
                    for key in self._existence.answered(outcome.keys, outcome.found) if current else ():
                        if key not in self._index:  # found again while its delete was pending: kept
                            self._evicted.pop(key, None)
                            self._evicted.update(dict.fromkeys(self._index.add_stored(key, self.object_bytes(key))))
                case StoreDone():
                    if current:
                        apply_store(self._index, self._counters, outcome, self.store.evicts_itself)
                    self._counters.stores.finish(outcome.job_id, outcome.at)
                case LoadDone():
                    if current:
                        apply_load(self._index, self._counters, self._existence, outcome, self.settings.probe_misses)
                    self._counters.loads.finish(outcome.job_id, outcome.at)
            if isinstance(outcome, StoreDone | LoadDone):
                self.health.record(len(outcome.ok), outcome.errors)
                results.append(JobResult(outcome.job_id, outcome.success, rows_in_use=outcome.rows_in_use))
                self._counters.counts["jobs_succeeded" if outcome.success else "jobs_failed"] += 1
        return results

    def attach_doorbell(self, doorbell: Doorbell) -> None:
        """Ring `doorbell` whenever an outcome is handed to this thread (scheduler thread)."""
        self._outbox.doorbell = doorbell
        doorbell.ring()  # outcomes handed over before now

    def attach_row_states(self, row_states: RowStates) -> None:
        """Settle each promoted row as its block is read and checked, from the loop thread
        (scheduler thread, once, before any job)."""
        self._worker.row_states = row_states

    def take_released_jobs(self) -> list[int]:
        """Jobs reported with ``rows_in_use`` whose late store calls have returned since the
        last call (their rows may be reused now). Scheduler thread, after `get_finished`;
        never blocks."""
        released, self._released = self._released, []
        return released

    def get_stats(self) -> TierStats:
        """Counters (lookups by answer, blocks and bytes stored and loaded, seconds busy, evictions,
        jobs succeeded and failed, failures by reason, events dropped), gauges (blocks and bytes held,
        capacity, jobs in flight, probes remembered, health, recovery running) and histograms of store and load job
        durations (submission to the end of the I/O). Cheap; scheduler thread."""
        alive, recovering = self._runtime.alive, self._recovery is not None
        return self._counters.snapshot(
            self._index, len(self._existence), self.health, alive, recovering, self._records.rewritten
        )

    @property
    def _serving(self) -> bool:
        """Healthy, with a live loop thread (`AsyncRuntime.alive`): else it misses and fails at once."""
        return self.health.healthy and self._runtime.alive

    def on_schedule_end(self) -> None:
        """Start the work submitted during the step (one wake-up of the loop), and, when an
        unhealthy tier's backoff has passed, its health probe. Nothing after shutdown, or
        once the loop thread is dead."""
        if self._closed or not self._runtime.alive:
            return
        if not self.health.healthy and self.health.ping_due():
            self._submit(self._worker.start_ping, outbox.PingDone())
        self._flush()

    def has_pending_work(self) -> bool:
        return self._outbox.pending()

    def enable_events(self) -> None:
        """Keep KV events from now on (`tiering.tiers.events`), the blocks held first."""
        self._index.start_events(TierEvents(self.medium, self.locality, self.name))

    def take_events(self) -> list[OffloadingEvent]:
        return [] if self._index.events is None else self._index.events.take()

    def drain(self, timeout_s: float | None = None) -> bool:
        """Block until every submitted operation finished (results may wait in the outbox).

        Raises:
            RuntimeError: called from the loop thread."""
        if self._runtime.in_loop_thread():
            raise RuntimeError(f"tier {self.name}: drain() from the loop thread would deadlock")
        if not self._runtime.alive:  # shut down, or a dead loop: what is left never ends
            return self._outbox.idle()
        if not self._closed:  # after shutdown nothing new can start; only wait
            self._flush()
        return self._outbox.wait_idle(timeout_s)

    def remove_namespace(self) -> None:
        """Wait for the jobs in flight (up to ``shutdown_timeout_s``), delete the tier's namespace
        whole (`BlockStore.remove_namespace`, up to ``open_timeout_s``) and the identity's records
        where this engine created them (`Records.remove`), then shut the tier down: for runs whose
        blocks must not outlive them (a benchmark's). Scheduler thread; blocks; nothing after shutdown.

        Raises:
            TimeoutError: the removal did not finish in time (the tier is shut down anyway).
            Exception: the store's own errors (as `BlockStore.delete_many`); the tier is shut
                down anyway.
        """
        if not self._closed:
            self.drain(self.settings.shutdown_timeout_s)
            self._shutdown_after(self.store.remove_namespace, self._records.remove)

    def abandon(self) -> None:
        """`shutdown`, after `BlockStore.undo_open` and `Records.remove` (each up to ``open_timeout_s``;
        a failure is logged): the engine failed to start, nothing was stored. Nothing after shutdown."""
        try:
            if not self._closed:
                self._shutdown_after(self.store.undo_open, self._records.remove)
        except Exception as exc:
            logger.warning("tier %s: could not remove what opening it created: %s", self.name, describe(exc))

    def _shutdown_after(self, *calls: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run `calls` on the loop, one after the other, each up to ``open_timeout_s``, forget
        every block, then shut down (also if a call raises)."""
        try:
            for call in calls:
                self._runtime.run_sync(call, timeout_s=self.settings.open_timeout_s)
            self._index = self._index.replaced_by(self._new_index())
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        """Cancel jobs in flight (each is reported as failed), close the store, release the
        runtime. Returns within ``shutdown_timeout_s`` seconds, also while a thread is stuck
        in a system call (it is left behind, logged). Later calls do nothing."""
        if self._closed:
            return
        self._closed = True
        timeout_s = self.settings.shutdown_timeout_s
        deadline = time.monotonic() + timeout_s
        try:
            self._runtime.flush()  # queued jobs reach the loop first, to be reported as failed
            self._runtime.run_sync(self._worker.stop, timeout_s=timeout_s)
        except TimeoutError:
            logger.warning("tier %s: I/O still running %.1f s into shutdown", self.name, timeout_s)
        except RuntimeClosedError:
            logger.warning("tier %s: its runtime was shut down before the tier", self.name)
        finally:
            self._runtime.release(timeout_s=max(0.1, deadline - time.monotonic()))

    # -- sizes ------------------------------------------------------------------------------

    def object_bytes(self, key: OffloadKey) -> int:
        """Bytes the stored object of `key` takes (header and payload), counted in capacity."""
        size = self._object_bytes.get(len(key))
        if size is None:
            size = self._object_bytes[len(key)] = object_size(len(key), self.row_bytes, self.store.header_align)
        return size

    def capacity_blocks(self, key: OffloadKey) -> int | None:
        """Objects of `key`'s size the tier holds at most now (its capacity, or what fits a
        full device); None: no capacity. Scheduler thread; never raises."""
        limit = self._index.limit()
        return None if limit is None else limit // self.object_bytes(key)

    @property
    def index(self) -> BlockIndex:
        """The current generation's `BlockIndex` (keys held or being stored, bytes, capacity), read-only."""
        return self._index

    # -- internals --------------------------------------------------------------------------

    def _submit(self, start: Callable[..., None], outcome: Outcome, *args: Any) -> None:
        """Queue ``start(outcome, *args)`` for the loop thread; it runs at the next flush.
        The outcome belongs to the current generation."""
        outcome.epoch = self._epoch
        self._outbox.task_started()
        self._runtime.submit(partial(start, outcome, *args))

    def _flush(self) -> None:
        """Send the step's existence checks, `batch_bytes` worth of blocks per call, and its
        deletes of evicted objects as one job; wake the loop."""
        pending = self._existence.take_pending()
        for start in range(0, len(pending), self._batch_blocks):
            keys = pending[start : start + self._batch_blocks]
            self._submit(self._worker.start_probe, outbox.ProbeDone(keys=keys))
        self._flush_deletes()
        self._runtime.flush()

    def _flush_deletes(self) -> None:  # the step's deletes of evicted objects, as one job
        if self._evicted:
            if self._recovery is not None:
                self._recovery.evicted.update(self._evicted)
            self._submit(self._worker.start_delete, outbox.DeletesDone(keys=list(self._evicted)))
            self._evicted.clear()
