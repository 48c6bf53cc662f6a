"""`Promotions`: blocks a lookup found in a secondary tier, loaded into the primary tier.

A lookup that misses the primary tier asks the secondary tiers in order (`find`); the
first that has the block, and whose `RecomputeGate` says loading beats recomputing, gets a
primary row reserved at once (`queue`) and the lookup answers None; the step's
reservations are submitted at its end as one load job per (tier, request)
(`on_schedule_end`). A gate's trial reserves its row only then, after the step's loads
were pinned. The rows promotions hold are bounded by `PromotionRows`; a block whose tier
settles its row's state as it lands is `PendingLoads` (a load may pin it early).

Thread: the scheduler thread only (owned by `TieringOffloadingManager`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tiering.contract.keys import OffloadKey, ReqContext
from tiering.cpu import row_states
from tiering.cpu.primary import CPUPrimaryTierOffloadingManager
from tiering.engine.jobs import Job, JobTable
from tiering.engine.recompute import RecomputeGate
from tiering.engine.tier_calls import Hooks, attached
from tiering.engine.timeline import RequestTimeline
from tiering.stats import Histogram
from tiering.tiers.base import SecondaryTierManager

logger = logging.getLogger(__name__)


@dataclass
class PromotionRows:
    """The CPU rows promotions may hold: `held` now (queued or in flight), at most
    `max_rows`, and only while more than `store_reserve` rows stay available to the GPU's
    stores; one promotion is always let through when none holds a row."""

    max_rows: int
    store_reserve: int
    held: int = 0

    def allow(self, available: int) -> bool:
        """Whether one more promotion may take a row, `available` rows being free or idle."""
        return not self.held or (self.held < self.max_rows and available > self.store_reserve)


@dataclass
class PendingLoads:
    """Promotions a load may pin before they land: those of the tiers that settle their
    rows' states (`settling_tiers`), by key (`keys`: key -> (tier index, `time.monotonic`
    when queued)), queued or in flight; `answer_hits`: lookups answer True for them while
    they are younger than `tiering.cpu.row_states.PROMOTION_WAIT_S` (`fresh`)."""

    settling_tiers: set[int]
    answer_hits: bool = False
    keys: dict[OffloadKey, tuple[int, float]] = field(default_factory=dict)

    def fresh(self, key: OffloadKey) -> bool:
        """Whether pending `key`'s promotion was queued less than `PROMOTION_WAIT_S` ago: a
        load submitted now could still see it land. An older one is stuck or slow (a frozen
        tier): a load would only wait for it in vain."""
        return time.monotonic() - self.keys[key][1] < row_states.PROMOTION_WAIT_S


@dataclass
class QueuedPromotion:
    """A request's blocks queued for promotion from one tier in this step, and their rows."""

    req_context: ReqContext
    keys: list[OffloadKey] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    queued_at: float = field(default_factory=time.perf_counter)


class Promotions:
    """The promotion queue of one engine, its bounds, gates and the blocks' sources."""

    def __init__(
        self,
        primary: CPUPrimaryTierOffloadingManager,
        tier_names: list[str],
        tiers: list[SecondaryTierManager],
        hooks: Hooks,
        jobs: JobTable,
        rows: PromotionRows,
        recompute_tokens_per_s: float | None,
        block_tokens: int | None,
        timeline: RequestTimeline | None,
    ):
        """Load jobs go to `jobs`, which knows the tiers not to promote from; `recompute_tokens_per_s`
        and `block_tokens` configure each tier's `RecomputeGate`; the tiers with an
        ``attach_row_states`` hook (in `hooks`) get the primary tier's row states."""
        self._primary = primary
        self._tier_names = tier_names
        self._tiers = tiers
        self._jobs = jobs
        self._timeline = timeline
        self.rows = rows
        self.gates = [RecomputeGate(recompute_tokens_per_s, block_tokens) for _ in tier_names]
        self.queued: dict[tuple[int, str], QueuedPromotion] = {}
        self.trials: list[tuple[int, OffloadKey, ReqContext]] = []  # (tier, key, request) of the step
        self._sources: dict[OffloadKey, str] = {}  # recently promoted keys -> tier name, oldest first
        self.counters = {"promotions_submitted": 0, "promotions_deferred": 0, "promotions_overdue": 0}
        self.seconds = Histogram()
        states = primary.row_states
        settling = [] if states is None else hooks["attach_row_states"]
        self.pending = PendingLoads(
            {
                idx
                for idx, tier in settling
                if attached(tier, "attach_row_states", states, "its hits wait for their promotions to land")
            }
        )

    def find(self, key: OffloadKey, req_context: ReqContext, step_hits: Collection[OffloadKey]) -> bool | None:
        """Ask the secondary tiers, in order, for a block the primary tier lacks; queue its
        promotion from the first that has it and beats recomputing (`queue`). None: queued,
        or ask again next step; False: a miss (the request recomputes). A tier that raises
        counts as a miss; an `unresponsive` one is not asked, nor one the request may not load
        from (``load_tiers``, set by `TieringOffloadingManager.on_new_request`)."""
        answer: bool | None = False
        unresponsive = self._jobs.unresponsive
        allowed = getattr(req_context, "load_tiers", None)
        for tier_idx, tier in enumerate(self._tiers):
            if (unresponsive and tier_idx in unresponsive) or (allowed is not None and tier_idx not in allowed):
                continue
            try:
                found = tier.lookup(key, req_context)
            except Exception:
                logger.exception("tier %s: lookup failed; counted as a miss", tier.tier_type)
                continue
            if found:
                queued = self.queued.get((tier_idx, req_context.req_id))
                decision = self.gates[tier_idx].decide(1 + (len(queued.keys) if queued else 0))
                if decision == "load":
                    return self.queue(tier_idx, key, req_context, step_hits)
                if decision == "trial":  # promoted in the background at the step's end; the request recomputes
                    self.trials.append((tier_idx, key, req_context))
                    return False
                continue  # recomputing beats this tier; a later one may be faster
            if found is None:
                answer = None
        return answer

    def queue(
        self, tier_idx: int, key: OffloadKey, req_context: ReqContext, step_hits: Collection[OffloadKey]
    ) -> bool | None:
        """Reserve a primary row for `key` (evicting none of `step_hits`) and queue its load:
        None (retry next step); False if the primary tier has no row for it."""
        if not self.rows.allow(self._primary.num_available_blocks):
            self.counters["promotions_deferred"] += 1
            return None
        settled = tier_idx in self.pending.settling_tiers
        reserved = self._primary.prepare_write([key], req_context, step_hits, settled)
        if reserved is None:
            return False
        if settled:
            self.pending.keys[key] = (tier_idx, time.monotonic())
        self.rows.held += 1
        queued = self.queued.get((tier_idx, req_context.req_id))
        if queued is None:
            queued = self.queued[(tier_idx, req_context.req_id)] = QueuedPromotion(req_context)
        queued.keys.append(key)
        queued.block_ids.append(int(reserved.store_spec.block_ids[0]))
        self.gates[tier_idx].queued(1)
        return None

    def early_hit(self, key: OffloadKey) -> bool:
        """Whether a lookup answers "hit" for pending `key` (`PendingLoads.fresh`); False, a
        recompute, once its promotion is older than `tiering.cpu.row_states.PROMOTION_WAIT_S`
        (counted in ``promotions_overdue``): a load would wait for it in vain."""
        fresh = self.pending.fresh(key)
        self.counters["promotions_overdue"] += not fresh
        return fresh

    def on_schedule_end(self, step_hits: Collection[OffloadKey]) -> bool:
        """Queue the step's trials, then submit every queued promotion. Returns whether a
        trial reserved a row (the primary tier changed)."""
        trials = self.trials
        if trials:  # their rows reserved only now: a reservation may evict, and the step's loads are pinned now
            for tier_idx, key, req_context in trials:
                if self._primary.ref_count(key) is None:
                    self.queue(tier_idx, key, req_context, step_hits)
            self.trials = []
        if self.queued:
            for (tier_idx, _), queued in self.queued.items():
                self.gates[tier_idx].submitted(len(queued.keys))
                block_ids = np.array(queued.block_ids, dtype=np.int64)
                self._jobs.submit_load(self, tier_idx, queued.keys, block_ids, queued.req_context, queued.queued_at)
                self.counters["promotions_submitted"] += 1
            self.queued.clear()
        return bool(trials)

    def drop_queued(self) -> None:
        """Give up the step's queued promotions and trials: their rows are freed."""
        self.trials.clear()
        for (tier_idx, _), queued in self.queued.items():
            self.gates[tier_idx].queued(-len(queued.keys))
            self.rows.held -= len(queued.keys)
            for key in queued.keys:
                self.pending.keys.pop(key, None)
            self._primary.complete_write(queued.keys, queued.req_context, success=False)
        self.queued.clear()

    def ended(self, job: Job, success: bool, held: bool) -> None:
        """A load job ended: its blocks become loadable (or, failed, misses). `held`: the
        tier's late I/O may still write the rows, which are quarantined until it ends."""
        self.rows.held -= len(job.keys)
        if self.pending.keys:
            for key in job.keys:
                self.pending.keys.pop(key, None)
        seconds = time.perf_counter() - job.queued_at
        self.gates[job.tier_idx].finished(len(job.keys), success and not job.voided, seconds)
        if held:
            if not job.voided:
                job.rows = self._primary.quarantine_writes(job.keys, job.req_context)
        elif job.voided:
            self._primary.release_rows(job.rows)
        else:
            promoted = self._primary.complete_write(job.keys, job.req_context, success)
            self._remember_sources(promoted, job.tier_idx)
            if promoted:
                self.seconds.observe(seconds)
                if self._timeline is not None:
                    self._timeline.promoted(job.req_context.req_id, self._tier_names[job.tier_idx], len(promoted))

    def released(self, job: Job) -> None:
        """A held load job's late I/O returned (`JobOwner.released`): its quarantined rows
        are free again."""
        self._primary.release_rows(job.rows)

    def source(self, key: OffloadKey) -> str | None:
        """See `TieringOffloadingManager.promotion_source`."""
        name = self._sources.get(key)
        if name is None and key in self.pending.keys:
            return self._tier_names[self.pending.keys[key][0]]
        return name

    def _remember_sources(self, keys: list[OffloadKey], tier_idx: int) -> None:
        sources, name = self._sources, self._tier_names[tier_idx]
        for key in keys:
            sources.pop(key, None)
            sources[key] = name
        while len(sources) > self._primary.num_blocks:
            del sources[next(iter(sources))]

    def forget(self, keys: Collection[OffloadKey] | None = None) -> None:
        """Forget where `keys` (None: every block) came from: they were stored anew, or the
        primary tier was emptied."""
        if keys is None:
            self._sources.clear()
            self.pending.keys.clear()
        elif self._sources:  # (none until a promotion lands: a GPU store then costs nothing here)
            sources = self._sources
            for key in keys:
                sources.pop(key, None)

    def gauges(self) -> dict[str, Any]:
        """``promotions_queued`` (blocks) and ``promotion_rows`` (rows held) for `get_stats`."""
        return {
            "promotions_queued": sum(len(queued.keys) for queued in self.queued.values()),
            "promotion_rows": self.rows.held,
        }
