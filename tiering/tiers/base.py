"""The secondary-tier contract: jobs, results and `SecondaryTierManager`.

Thread: every `SecondaryTierManager` method is called from the scheduler thread.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from tiering.contract.keys import OffloadKey, ReqContext
from tiering.contract.mediums import LOCAL, STORAGE, OffloadingEvent
from tiering.cpu.row_states import RowStates
from tiering.tiers.context import TierContext

JobId = int
"""Identifies one submitted job; all tiers of a manager draw from one counter."""


@dataclass
class JobMetadata:
    """One job handed to a secondary tier.

    Attributes:
        job_id: unique among the jobs of the manager.
        keys: the blocks moved, in the order of `block_ids`.
        block_ids: primary-tier rows, int64 array of shape ``(len(keys),)``. For a store
            (cascade) the tier reads these rows; they stay pinned until the job is reported.
            For a load (promotion) the tier writes them.
        is_promotion: True for a load into the primary tier, False for a store from it.
        req_context: the request the job was made for.
    """

    job_id: JobId
    keys: Collection[OffloadKey]
    block_ids: np.ndarray
    is_promotion: bool
    req_context: ReqContext


class Doorbell:
    """Tells the scheduler thread that a tier has something to report, so that an idle step
    polls nothing. The manager gives one to every tier that implements
    `SecondaryTierManager.attach_doorbell`; such a tier calls `ring` from any thread.
    `rung` is True from construction until the manager resets it, just before it polls."""

    __slots__ = ("rung",)

    def __init__(self) -> None:
        self.rung = True

    def ring(self) -> None:
        """Any thread: something new waits in `get_finished` or `take_released_jobs`."""
        self.rung = True


@dataclass
class JobResult:
    """How a job ended: ``success`` is True only if every block of the job was moved.

    ``rows_in_use`` (only with ``success`` False): an I/O of the job timed out but has not
    returned (a thread stuck in a system call) and may still read or write the job's primary
    rows. The manager keeps those rows out of use (a failed promotion's rows are
    quarantined, a failed cascade's rows stay pinned) until the tier lists the job in
    `SecondaryTierManager.take_released_jobs`.
    """

    job_id: JobId
    success: bool
    rows_in_use: bool = False


class SecondaryTierManager(ABC):
    """One secondary tier: a store of blocks that never touches the GPU.

    Data moves only through the primary tier: stores copy primary rows out (cascade),
    loads copy into primary rows (promotion). Every method is called from the scheduler
    thread and must return in microseconds: `submit_store` and `submit_load` hand the copy to
    something else and report it later through `get_finished`. A tier reports every
    submitted job exactly once, also when it shuts down with the job still in flight.

    The optional hooks (`touch`, `on_schedule_end`, `take_released_jobs`, `take_events`,
    `attach_doorbell`, `retain`, `release`) are called only if the tier's class overrides them: the manager
    looks once, when it is built, so a default hook costs nothing per step (a hook set on
    the instance later is not seen).

    Attributes:
        medium: where the tier keeps blocks, for KV events and a request's ``kv_load_tiers``
            (`tiering.contract.mediums`): `STORAGE` unless a subclass says otherwise.
        locality: `LOCAL` (this machine, the default) or `REMOTE` (over the network, or
            shared with other engines).
        lasting: whether its blocks outlive the engine (True, the default; False for a tier
            in the engine's memory): a graceful stop writes the blocks only the CPU tier holds
            to the first lasting tier (`tiering.engine.drain`).
    """

    medium: str = STORAGE
    locality: str = LOCAL
    lasting: bool = True

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str):
        """
        Args:
            offloading_spec: what the engine gives the tier: a `TierContext` (the factory
                passes one), the `TieringOffloadingSpec` building it, or None for standalone
                use (see `TierContext.of`).
            primary_kv_view: the primary tier's rows, a 2-D memoryview of shape
                ``(num_blocks, row_bytes)``.
            tier_type: the registered type name this tier was built under.

        Attributes:
            context: the `TierContext` (name, primary rows, layout fingerprint, runtime).
            name: the tier's name in stats, metrics and logs.

        Raises:
            TypeError: `offloading_spec` is not one of the above.
        """
        self.context = TierContext.of(offloading_spec, primary_kv_view, tier_type)
        self.name = self.context.name
        self._offloading_spec = self.context.spec
        self._primary_kv_view = primary_kv_view
        self.tier_type = tier_type

    @abstractmethod
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        """True if the block is here and loadable, False if not, None if still in flight."""

    @abstractmethod
    def submit_store(self, job_metadata: JobMetadata) -> None:
        """Start copying the job's primary rows into this tier; never copy on this thread.

        The tier skips blocks it already holds and evicts to make room as it sees fit.
        """

    @abstractmethod
    def submit_load(self, job_metadata: JobMetadata) -> None:
        """Start copying the job's blocks from this tier into its primary rows."""

    @abstractmethod
    def get_finished(self) -> Iterable[JobResult]:
        """Results of the jobs that finished since the last call; never blocks."""

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Mark blocks as recently used for this tier's eviction."""
        return

    def on_schedule_end(self) -> None:
        """Called at the end of each scheduler step, after the step's jobs were submitted."""
        return

    def retain(self, keys: Collection[OffloadKey], seconds: float) -> Collection[OffloadKey]:
        """Optional: a finished request asked to retain `keys` (`tiering.eviction.retention`): give
        those held here a deadline `seconds` from now for this tier's eviction (soft: passed
        over while other blocks can go, within a share of the tier). Returns the keys not
        held here (nor being stored): the manager writes them when the tier's admission says
        a retention this long must reach it (``retained_write_s``), then calls again with
        them. The default keeps no deadlines and reports nothing missing."""
        return ()

    def release(self, keys: Collection[OffloadKey]) -> None:
        """Optional: a finished request said its session is over: `keys` (the blocks it
        stored itself) lose their deadlines and are this tier's first victims."""
        return

    def new_generation(self, weight_version: str | None = None) -> None:
        """Optional: the engine reset its cache (`reset_cache`, as after a weight update) and
        now computes with the weights `weight_version` declares (None: weights no other engine
        is known to share): forget every block and never offer one computed with other
        weights, here or, for a tier that outlives the engine, to any engine
        (`tiering.tiers.blockstore.generations`: a namespace per identity and weights).
        Scheduler thread; must return at once (no I/O). Jobs in flight are still reported. A
        tier without this hook keeps its blocks across resets (the manager logs it at each
        reset); one whose hook takes no argument is called without it."""
        return

    def capacity_blocks(self, key: OffloadKey) -> int | None:
        """Optional: how many blocks the size of `key`'s this tier holds at most; None (the
        default): no bound known. A stop's drain writes no more than that to it."""
        return None

    def has_pending_work(self) -> bool:
        """Whether a submitted job has not been reported by `get_finished` yet."""
        return False

    def drain(self, timeout_s: float | None = None) -> bool:
        """Block until every submitted job has finished, or `timeout_s` seconds pass.

        May block: call it only outside the scheduler's step (reset, shutdown, tests).
        None waits without a limit. Returns True if nothing is left in flight.
        """
        return True

    def take_released_jobs(self) -> Iterable[JobId]:
        """Jobs reported with ``rows_in_use`` whose I/O has returned since the last call;
        their rows may be reused. Called from the scheduler thread after `get_finished`;
        must not block. The default has none."""
        return ()

    def attach_doorbell(self, doorbell: Doorbell) -> None:
        """Optional: take the manager's `Doorbell` (called once, when the manager is built)
        and `ring` it, from any thread, as soon as `get_finished` or `take_released_jobs`
        has something new. The manager then polls this tier only in steps after a ring; a
        tier without this hook is polled every step."""
        return

    def attach_row_states(self, row_states: RowStates) -> None:
        """Optional: take the primary rows' promotion states (called once, when the manager
        is built, where the primary tier has them) and, for every promotion (`submit_load`),
        `RowStates.settle` each block's row from any thread as soon as its bytes are in the
        row and checked (or its read failed), before reporting the job. A load may then pin
        this tier's promotions before they land, its worker waiting for the rows: a hit in
        the step it is found (`tiering.cpu.row_states`). A tier without this hook settles
        nothing; its blocks are loadable once the manager processes its job."""
        return

    def get_stats(self) -> dict[str, Any]:
        """``{"counters": {...}, "gauges": {...}, "histograms": {...}}`` of this tier (see
        `tiering.stats`; a part may be left out); cheap, scheduler thread. The default has
        none."""
        return {"counters": {}, "gauges": {}, "histograms": {}}

    def enable_events(self) -> None:
        """Optional: start keeping KV events for `take_events` (called once, when a manager
        built with events is; before it, a tier keeps none), announcing the blocks the tier
        holds already (those it recovered). `tiering.tiers.events.TierEvents` keeps them."""
        return

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Keys this tier gained or dropped since the last call, for KV-event consumers:
        `OffloadingEvent`s with the tier's medium (`STORAGE` unless it says otherwise), its
        locality (`LOCAL` on this machine, `REMOTE` over the network or shared with other
        engines) and its name as the owner (`tiering.tiers.events`)."""
        return ()

    def shutdown(self) -> None:
        """Release threads, connections and files. Safe to call more than once."""
        return

    def abandon(self) -> None:
        """Shut down a tier opened by an engine whose start then failed (a later tier did
        not open): also undo what opening created, where nothing was stored in it (an empty
        directory tree). Called instead of `shutdown`, from the thread that started the
        engine. Default: `shutdown`."""
        self.shutdown()
