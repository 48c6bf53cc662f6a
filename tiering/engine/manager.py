"""`TieringOffloadingManager`: the primary tier plus secondary tiers behind one manager.

Store path (cascade): ``complete_store`` makes blocks loadable in the primary tier and, at
once, submits one store job per secondary tier, each holding one read reference on every
block's row until the tier reports the job. Each tier's `TierAdmission` decides which of the
blocks it gets (a bound on the rows it pins, shedding while it is behind, a reuse filter);
the others stay in the primary tier only.

Load path (promotion): a ``lookup`` that misses the primary tier asks the secondary tiers in
order; the first that has the block, and loads it sooner than the model would recompute it
(`tiering.tiers.recompute`, when the prefill rate is configured), gets it promoted. A primary row
is reserved at once (so a second lookup sees the block in flight and queues nothing), the
lookup answers None, and the step's promotions are submitted at ``on_schedule_end`` as one
load job per (tier, request). A promotion takes a row only while ``store_reserve_rows`` rows
stay available beyond it (free, or idle and evictable) for the GPU's stores, and while
promotions hold fewer than ``max_promotion_rows`` (no cap by default); past that a lookup
answers None (retry next step, ``promotions_deferred``) instead of reserving, so a queue of
waiting requests, each looked up every step, cannot fill the primary tier with promotions
and leave the GPU's stores no row. A promotion never evicts a block that a lookup of the
same step found in the primary tier: a request is about to load it.

Finished jobs are processed once before the step's first ``lookup``/``prepare_store`` and
once in ``on_schedule_end``; a tier that rings the manager's `Doorbell` is polled only after
a ring, so an idle step asks no tier anything. A tier that raises is logged and its job
counted as failed; no backend exception reaches the scheduler.

A job its tier has not reported ``job_deadline_s`` after its submission fails here
(``jobs_expired``): a promotion's blocks become misses (the request recomputes) and its rows
are quarantined, a cascade's rows stay pinned, until the tier reports the job after all (its
I/O may still use them). Until the tier reports any job again, no block is promoted from it:
a tier with a bug, or whose event loop died, strands no request.

Thread: the scheduler thread only (`shutdown` may block; every other method
returns in microseconds).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tiering.contract.keys import OffloadKey, ReqContext, RequestOffloadingContext
from tiering.contract.mediums import CPULoadStoreSpec, OffloadingEvent, PrepareStoreOutput
from tiering.contract.offloading import OffloadingManager
from tiering.cpu.primary import CPUPrimaryTierOffloadingManager
from tiering.engine.jobs import (
    JOB_DEADLINE_S,
    Deadlines,
    Job,
    PendingLoads,
    Polled,
    Polling,
    PromotionRows,
    QueuedPromotion,
)
from tiering.engine.lookups import RequestLookups
from tiering.engine.tier_calls import attached, guarded, overrides
from tiering.engine.timeline import RequestTimeline
from tiering.eviction.retention import RetentionHint, hint_of
from tiering.stats import Histogram
from tiering.tiers.admission import AdmissionConfig, TierAdmission
from tiering.tiers.base import Doorbell, JobId, JobMetadata, SecondaryTierManager
from tiering.tiers.context import PRIMARY_NAME, unique_names
from tiering.tiers.recompute import RecomputeGate

logger = logging.getLogger(__name__)

_BACKGROUND = ReqContext("background")  # the request of cascades no request waits on: write-backs, deferred ones


class TieringOffloadingManager(OffloadingManager):
    """The scheduler's manager over a CPU primary tier and ordered secondary tiers.

    Call every method from the scheduler thread; none blocks or does I/O, except
    `shutdown`, which waits for the tiers to shut down.
    """

    def __init__(
        self,
        primary_tier: CPUPrimaryTierOffloadingManager,
        secondary_tiers: Sequence[SecondaryTierManager] | None = None,
        enable_events: bool = False,
        admission: Sequence[AdmissionConfig | None] | None = None,
        block_tokens: int | None = None,
        recompute_tokens_per_s: float | None = None,
        request_log: str | Path | None = None,
        max_promotion_rows: int | None = None,
        store_reserve_rows: int = 0,
        job_deadline_s: float | None = JOB_DEADLINE_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        """
        Args:
            primary_tier: the CPU tier; the only one that talks to the GPU.
            secondary_tiers: looked up in this order on a primary miss.
            enable_events: return the tiers' events from `take_events`.
            admission: per secondary tier, in order, its `AdmissionConfig` (None, or a
                shorter list: the defaults).
            block_tokens: tokens per block, for the token counters of `get_stats`; None
                leaves them out (block counts only).
            recompute_tokens_per_s: the model's prefill rate, prompt tokens per second: a
                block only a tier slower than that holds is a miss (`tiering.tiers.recompute`);
                None (or no `block_tokens`): every block found is promoted.
            request_log: a JSON Lines file that gets a line per finished request: when
                its prefix was looked up, loaded and promoted (`tiering.engine.timeline`); None: off.
            max_promotion_rows: primary rows that promotions queued or in flight may hold at
                once; None: no cap beyond `store_reserve_rows`.
            store_reserve_rows: rows kept available for the GPU's stores: a promotion takes a
                row only if more than this many are available (free, or idle and evictable)
                when it asks, or if no promotion holds a row (so one always starts). Under
                vLLM, one scheduler step's stores (`tiering.integrations.vllm`).
            job_deadline_s: seconds a secondary tier has to report a job before it fails
                here (see the module docstring); None: no deadline.
            clock: seconds, monotonic: when jobs are due (tests move it by hand).

        Raises:
            ValueError: more admission configs than tiers.
            OSError: `request_log` cannot be opened for appending.
        """
        self.primary_tier = primary_tier
        self.secondary_tiers = list(secondary_tiers or ())
        self._enable_events = enable_events
        self._job_ids = itertools.count()
        self._jobs: dict[JobId, Job] = {}
        self._sources: dict[OffloadKey, str] = {}  # recently promoted keys -> tier name, oldest first
        self._held: dict[tuple[int, JobId], Job] = {}  # jobs whose late I/O still uses their rows
        self._promotions: dict[tuple[int, str], QueuedPromotion] = {}
        self._trials: list[tuple[int, OffloadKey, ReqContext]] = []  # (tier, key, request) of the step
        self._polled_this_step = False
        self._shut_down = False
        self.tier_names = unique_names([getattr(tier, "name", tier.tier_type) for tier in self.secondary_tiers])
        configs = list(admission or ())
        if len(configs) > len(self.secondary_tiers):
            raise ValueError(f"{len(configs)} admission configs for {len(self.secondary_tiers)} secondary tiers")
        configs += [None] * (len(self.secondary_tiers) - len(configs))
        rows, tiers = primary_tier.num_blocks, max(1, len(configs))
        self.admission = [TierAdmission(config or AdmissionConfig(), rows, tiers) for config in configs]
        self.gates = [RecomputeGate(recompute_tokens_per_s, block_tokens) for _ in self.secondary_tiers]
        self.block_tokens = block_tokens
        counted = ("promotions_submitted", "promotions_deferred", "cascades_submitted", "jobs_expired")
        self._counters = dict.fromkeys(counted, 0)
        self._deadlines = Deadlines(job_deadline_s, clock)
        # (few attributes: past 30, CPython stops sharing instance dict keys and every attribute read slows)
        self.promotion_rows = PromotionRows(max_promotion_rows or primary_tier.num_blocks, store_reserve_rows)
        self._step_hits: set[OffloadKey] = set()  # found in the primary tier by this step's lookups
        self._requests = RequestLookups(self.promotion_source)
        self._promotion_seconds = Histogram()
        self._listeners: list[list[Any]] = []  # [callback, interval_s, next due]
        self._timeline = RequestTimeline(request_log) if request_log is not None else None
        # Per hook, the tiers that implement it: a default (no-op) hook is not called each step.
        self._hooks = {
            name: [(idx, tier) for idx, tier in enumerate(self.secondary_tiers) if overrides(tier, name)]
            for name in (
                "touch",
                "take_events",
                "on_schedule_end",
                "take_released_jobs",
                "attach_doorbell",
                "attach_row_states",
                "retain",
                "release",
            )
        }
        # Tiers that ring the doorbell are polled only after a ring; the others every step.
        doorbell = Doorbell()
        ringing = {
            idx
            for idx, tier in self._hooks["attach_doorbell"]
            if attached(tier, "attach_doorbell", doorbell, "it is polled every step")
        }
        releasing = {idx for idx, _ in self._hooks["take_released_jobs"]}
        polled = [(idx, tier, idx in releasing) for idx, tier in enumerate(self.secondary_tiers)]
        self._polling = Polling(
            doorbell,
            [entry for entry in polled if entry[0] in ringing],
            [entry for entry in polled if entry[0] not in ringing],
        )
        self._write_back_tiers = [idx for idx, admission in enumerate(self.admission) if admission.write_back]
        # whether the primary tier's blocks, their order or their readers may have changed
        # since the last write-back scan (one that found nothing to copy finds nothing again)
        self._primary_changed = True
        states = primary_tier.row_states
        settling = [] if states is None else self._hooks["attach_row_states"]
        self._pending = PendingLoads(
            {
                idx
                for idx, tier in settling
                if attached(tier, "attach_row_states", states, "its hits wait for their promotions to land")
            }
        )
        self._waiting_tiers: set[int] = set()  # tiers with cascades waiting for room

    # -- scheduler calls ------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        """True if `key` is loadable from the primary tier; None to retry next step (a
        transfer is in flight, a promotion was just queued, or a tier is still unsure);
        False if no tier has it or the primary tier has no room to promote it. With
        `answer_pending_hits`, a block whose promotion is `pending_loadable` is True at once."""
        if not self._polled_this_step:
            self._process_finished()
        answer = self.primary_tier.lookup(key, req_context)
        if answer is False:
            answer = self._lookup_secondary(key, req_context)
        elif answer:
            self._step_hits.add(key)
        if answer is None and self._pending.answer_hits and key in self._pending.keys:
            answer = True  # loadable now: the worker's load waits for the row
            self._requests.answered(req_context.req_id, key, answer, self.promotion_source(key))
        else:
            self._requests.answered(req_context.req_id, key, answer)
        if self._timeline is not None:
            self._timeline.looked_up(req_context.req_id)
        return answer

    def _lookup_secondary(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        answer: bool | None = False
        unresponsive = self._deadlines.unresponsive
        for tier_idx, tier in enumerate(self.secondary_tiers):
            if unresponsive and tier_idx in unresponsive:
                continue
            try:
                found = tier.lookup(key, req_context)
            except Exception:
                logger.exception("tier %s: lookup failed; counted as a miss", tier.tier_type)
                continue
            if found:
                queued = self._promotions.get((tier_idx, req_context.req_id))
                decision = self.gates[tier_idx].decide(1 + (len(queued.keys) if queued else 0))
                if decision == "load":
                    return self._queue_promotion(tier_idx, key, req_context)
                if decision == "trial":  # promoted in the background at the step's end; the request recomputes
                    self._trials.append((tier_idx, key, req_context))
                    return False
                continue  # recomputing beats this tier; a later one may be faster
            if found is None:
                answer = None
        return answer

    def pending_loadable(self, key: OffloadKey) -> bool:
        """Whether `key`'s row is being filled by a promotion whose tier settles the row's
        state as it lands (`tiering.cpu.row_states`): `prepare_load` may pin it now, and the
        worker's load waits for the row, copying nothing from it if the promotion fails.
        A caller whose loads wait so (the engine's vLLM connector; vLLM's own cannot) sets
        `answer_pending_hits` and such lookups answer True. Scheduler thread; never raises."""
        return key in self._pending.keys

    @property
    def answer_pending_hits(self) -> bool:
        """Whether a lookup answers True for a block whose promotion is `pending_loadable`
        (False by default: the seeds' contract answers None until it lands). Set by a caller
        whose loads wait for the rows: the engine's vLLM connector."""
        return self._pending.answer_hits

    @answer_pending_hits.setter
    def answer_pending_hits(self, value: bool) -> None:
        self._pending.answer_hits = value

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> CPULoadStoreSpec:
        """Pin primary rows for a GPU load; see `CPUOffloadingManager.prepare_load`. Keys
        whose promotion is `pending_loadable` may be pinned before it lands.

        Raises:
            KeyError: a key is not loadable from the primary tier.
        """
        pending = self._pending.keys
        self._primary_changed = True
        spec = self.primary_tier.prepare_load(keys, req_context, pending)
        if self._timeline is not None:
            early = sum(key in pending for key in keys) if pending else 0
            self._timeline.load_prepared(req_context.req_id, len(keys), early)
        return spec

    def load_waited(self, req_id: str, seconds: float) -> None:
        """The worker's load for request `req_id` waited `seconds` for rows still being
        promoted (a hit answered early): for the request log. Scheduler thread."""
        if self._timeline is not None:
            self._timeline.load_waited(req_id, seconds)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Record a use of `keys` in the primary tier and in every secondary tier."""
        self._primary_changed = True
        self.primary_tier.touch(keys, req_context)
        for _, tier in self._hooks["touch"]:
            guarded(tier, "touch", None, keys, req_context)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Unpin rows pinned by `prepare_load`.

        Raises:
            KeyError: a key has no reader.
        """
        self._primary_changed = True
        self.primary_tier.complete_load(keys, req_context)
        if self._timeline is not None:
            self._timeline.load_completed(req_context.req_id)

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        """Reserve primary rows for a GPU store; None if the primary tier has no room."""
        if not self._polled_this_step:
            self._process_finished()
        self._requests.stored(req_context.req_id, keys)
        self._primary_changed = True
        return self.primary_tier.prepare_store(keys, req_context)

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        """Finish a GPU store and cascade the newly stored blocks to every secondary tier."""
        self._primary_changed = True
        stored = self.primary_tier.complete_store(keys, req_context, success)
        if not stored:
            return
        for key in stored:
            self._sources.pop(key, None)
        cascades = []
        for tier_idx, admission in enumerate(self.admission):
            admission.stored(stored)
            if not admission.write_back:
                cascades.append((tier_idx, admission.admit(stored)))
                if admission.waiting:
                    self._waiting_tiers.add(tier_idx)
        self._cascade_to_all(cascades, req_context)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return self.primary_tier.on_new_request(req_context)

    def on_request_finished(self, req_context: ReqContext) -> None:
        """Forget the request's lookups (see `tiering.engine.lookups`); pass its retention hint to
        every tier (`tiering.eviction.retention`). Its queued promotions still run (other requests
        share prefixes)."""
        blocks = self._requests.finished(req_context.req_id)
        self._primary_changed = True
        self.primary_tier.on_request_finished(req_context)
        if blocks and (self._hooks["retain"] or self._hooks["release"]):
            primary = self.primary_tier
            hint = hint_of(req_context, log=primary.retention is None and primary.tenants is None)  # else logged there
            if hint is not None:
                self._hint_secondary_tiers(hint, blocks, req_context)
        if self._timeline is not None:
            self._timeline.finished(req_context.req_id)

    def _hint_secondary_tiers(
        self, hint: RetentionHint, blocks: dict[OffloadKey, bool], req_context: ReqContext
    ) -> None:
        """Release the blocks the request did not find (it stored them: its own) and retain
        all of them, in every tier with those hooks; blocks a tier lacks are written to it
        where its admission says the retention is long enough, and retained there too."""
        if hint.release:
            own = [key for key, found in blocks.items() if not found]
            for _, tier in self._hooks["release"]:
                guarded(tier, "release", None, own)
        if hint.retain_s is None:
            return
        keys = list(blocks)
        for tier_idx, tier in self._hooks["retain"]:
            missing = guarded(tier, "retain", (), keys, hint.retain_s)
            if missing:
                readable = [key for key in missing if self._readable(key)]
                written = self.admission[tier_idx].admit_retained(readable, hint.retain_s)
                self._cascade([tier_idx], written, req_context)
                if written:
                    guarded(tier, "retain", (), written, hint.retain_s)

    def take_events(self) -> list[OffloadingEvent]:
        """Events of the primary tier, then of each secondary tier, since the last call;
        empty unless the manager was built with ``enable_events=True``."""
        events = self.primary_tier.take_events()
        if self._hooks["take_events"]:
            events = list(events)
            for _, tier in self._hooks["take_events"]:
                events.extend(guarded(tier, "take_events", []))
        return events if self._enable_events else []

    def on_schedule_end(self) -> None:
        """Process finished jobs, submit the step's promotions, write-backs and the cascades
        that waited for room (see `tiering.tiers.admission`), then let tiers flush."""
        if self._polling.doorbell.rung or self._polling.every_step:
            self._process_finished()
        if self._jobs and self._deadlines.seconds is not None:
            self._expire_overdue()
        if self._trials:  # their rows reserved only now: a reservation may evict, and the step's loads are pinned now
            for tier_idx, key, req_context in self._trials:
                if self.primary_tier.ref_count(key) is None:
                    self._queue_promotion(tier_idx, key, req_context)
            self._trials.clear()
        if self._promotions:
            for (tier_idx, _), queued in self._promotions.items():
                self.gates[tier_idx].submitted(len(queued.keys))
                block_ids = np.array(queued.block_ids, dtype=np.int64)
                self._submit(tier_idx, queued.keys, block_ids, True, queued.req_context, queued.queued_at)
                self._counters["promotions_submitted"] += 1
            self._promotions.clear()
        if self._primary_changed:
            for tier_idx in self._write_back_tiers:
                self._write_back(tier_idx, self.admission[tier_idx])
            self._primary_changed = False
        if self._waiting_tiers:
            for tier_idx in list(self._waiting_tiers):
                admission = self.admission[tier_idx]
                self._cascade([tier_idx], admission.admit_waiting(self._readable), _BACKGROUND)
                if not admission.waiting:
                    self._waiting_tiers.discard(tier_idx)
        for _, tier in self._hooks["on_schedule_end"]:
            guarded(tier, "on_schedule_end", None)
        if self._listeners:
            self._publish_stats()
        if self._timeline is not None:
            self._timeline.step_ended()
        if self._step_hits:
            self._step_hits.clear()
        self._polled_this_step = False

    def promotion_source(self, key: OffloadKey) -> str | None:
        """The name (`tier_names`) of the secondary tier `key` was last promoted from, if it
        was promoted recently (the last ``num_blocks`` promotions are remembered) or is
        `pending_loadable`, else None: the block reached the primary tier from the GPU.
        Scheduler thread; never raises."""
        name = self._sources.get(key)
        if name is None and key in self._pending.keys:
            return self.tier_names[self._pending.keys[key]]
        return name

    def _remember_sources(self, keys: list[OffloadKey], tier_idx: int) -> None:
        sources, name = self._sources, self.tier_names[tier_idx]
        for key in keys:
            sources.pop(key, None)
            sources[key] = name
        while len(sources) > self.primary_tier.num_blocks:
            del sources[next(iter(sources))]

    def get_stats(self) -> dict[str, Any]:
        """A snapshot of every counter, gauge and histogram; README.md ("Observability")
        documents each name. Scheduler thread; cheap (no I/O, nothing scanned).

        Returns:
            ``{"primary": stats, "tiers": {name: stats}, "manager": stats}`` (and ``"tenants":
            {name: stats}`` with a ``tenants`` config), each ``stats`` shaped ``{"counters":
            {...}, "gauges": {...}, "histograms": {...}}`` (see `tiering.stats`). ``primary``
            and each tier (by `tier_names`) is its own `get_stats()` plus the lookups counted
            per request (``hit_blocks``, and ``hit_tokens`` when `block_tokens` is set; see
            `tiering.engine.lookups`); each secondary tier adds its admission's counters
            (``cascades_admitted``, ``cascades_deferred``, ``cascades_dropped``,
            ``cascades_filtered``, ``cascades_retained``) and gauges (``rows_in_flight``,
            ``cascades_waiting``), and the promotions its `RecomputeGate` declined
            (``promotions_declined``). ``manager`` has the request-level counters
            (``requested_blocks``, ``requested_tokens``, ``lookups_repeated``), the requests
            open (``requests_open``), jobs submitted, jobs and promotions in flight, and the
            ``promotion_seconds`` histogram (from the lookup that queued a promotion to its
            blocks being loadable). ``tenants``, with a ``tenants`` config, has per tenant (the
            `TenantsConfig.metric_tenants` most active by name, the rest as ``other``) the CPU
            tier's ``hits``, ``misses``, ``blocks_stored`` and ``bytes_stored`` counters and
            ``blocks``, ``bytes`` and ``share_blocks`` gauges.
        """
        requests = self._requests
        primary = self.primary_tier.get_stats()
        primary["counters"].update(self._hit_counters(PRIMARY_NAME))
        tiers = {}
        for name, tier, admission, gate in zip(
            self.tier_names, self.secondary_tiers, self.admission, self.gates, strict=True
        ):
            stats = dict(guarded(tier, "get_stats", {}))
            stats["counters"] = {
                **stats.get("counters", {}),
                **admission.counters,
                "promotions_declined": gate.declined,
                **self._hit_counters(name),
            }
            stats["gauges"] = {
                **stats.get("gauges", {}),
                "rows_in_flight": admission.rows_in_flight,
                "cascades_waiting": len(admission.waiting),
            }
            stats.setdefault("histograms", {})
            tiers[name] = stats
        counters: dict[str, Any] = {**self._counters, "requested_blocks": requests.requested_blocks}
        if self.block_tokens is not None:
            counters["requested_tokens"] = requests.requested_blocks * self.block_tokens
        counters["lookups_repeated"] = requests.lookups_repeated
        counters["hit_blocks_by_group"] = {
            str(group): count for group, count in sorted(requests.hit_blocks_by_group.items())
        }
        gauges = {
            "requests_open": len(requests),
            "jobs_in_flight": len(self._jobs),
            "jobs_holding_rows": len(self._held),
            "promotions_queued": sum(len(queued.keys) for queued in self._promotions.values()),
            "promotion_rows": self.promotion_rows.held,
        }
        histograms = {"promotion_seconds": self._promotion_seconds.snapshot()}
        manager = {"counters": counters, "gauges": gauges, "histograms": histograms}
        snapshot = {"primary": primary, "tiers": tiers, "manager": manager}
        if self.primary_tier.tenants is not None:
            snapshot["tenants"] = self.primary_tier.tenants.stats()
        return snapshot

    def _hit_counters(self, name: str) -> dict[str, int]:
        blocks = self._requests.hit_blocks[name]
        if self.block_tokens is None:
            return {"hit_blocks": blocks}
        return {"hit_blocks": blocks, "hit_tokens": blocks * self.block_tokens}

    def add_stats_listener(self, callback: Callable[[dict[str, Any]], None], interval_s: float = 1.0) -> None:
        """Call ``callback(get_stats())`` from `on_schedule_end`, at most every `interval_s`
        seconds, on the scheduler thread (a metrics exporter publishes from there, so it
        never reads the engine from its own thread). A raising callback is logged."""
        self._listeners.append([callback, interval_s, 0.0])

    def _publish_stats(self) -> None:
        now = time.monotonic()
        due = [listener for listener in self._listeners if now >= listener[2]]
        if not due:
            return
        stats = self.get_stats()
        for listener in due:
            listener[2] = now + listener[1]
            try:
                listener[0](stats)
            except Exception:
                logger.exception("stats listener %r failed", listener[0])

    def has_pending_work(self) -> bool:
        """Whether a promotion is queued or a job has not been reported yet."""
        return bool(self._jobs or self._promotions)

    def reset_cache(self) -> None:
        """Process what finished, drop queued promotions and empty the primary tier (see
        `CPUOffloadingManager.reset_cache`: the caller's transfers started before the reset
        are void, as under vLLM). Secondary tiers keep their blocks. Returns at once,
        whatever the tiers do: it waits for no tier (vLLM resets from its scheduler loop,
        where a wait for a frozen tier would stop serving every request).

        A secondary tier's job still in flight is void: its keys are forgotten at once (no
        lookup waits on them), its rows stay out of use until the tier reports it (or, after
        a timeout, releases its late I/O), and it is then counted as failed. So every row
        comes back and nothing is left waiting.
        """
        self._process_finished()
        self._drop_queued_promotions()
        # Rows of a held promotion are quarantined already; every other job's need a hold.
        in_flight = [*self._jobs.values(), *(job for job in self._held.values() if not job.is_promotion)]
        held = [job for job in in_flight if not job.voided]
        for job in held:
            job.voided = True
        self.primary_tier.reset_cache(keep_rows=[row for job in held for row in job.rows])
        self._primary_changed = True
        self._sources.clear()
        self._pending.keys.clear()

    def __enter__(self) -> TieringOffloadingManager:
        """``with TieringOffloadingManager(...) as manager:`` shuts it down on exit."""
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Shut every secondary tier (which reports its jobs in flight as failed), release
        the primary tier and its shared memory. Later calls do nothing."""
        if self._shut_down:
            return
        self._shut_down = True
        self._drop_queued_promotions()
        for tier in self.secondary_tiers:
            guarded(tier, "shutdown", None)
        self._process_finished()
        if self._jobs:
            logger.warning("%d jobs were never reported by their tiers", len(self._jobs))
        self.primary_tier.shutdown()
        if self._timeline is not None:
            self._timeline.close()

    # -- internals ------------------------------------------------------------------------

    def _queue_promotion(self, tier_idx: int, key: OffloadKey, req_context: ReqContext) -> bool | None:
        if not self.promotion_rows.allow(self.primary_tier.num_available_blocks):
            self._counters["promotions_deferred"] += 1
            return None
        settled = tier_idx in self._pending.settling_tiers
        self._primary_changed = True
        reserved = self.primary_tier.prepare_write([key], req_context, self._step_hits, settled)
        if reserved is None:
            return False
        if settled:
            self._pending.keys[key] = tier_idx
        self.promotion_rows.held += 1
        queued = self._promotions.get((tier_idx, req_context.req_id))
        if queued is None:
            queued = self._promotions[(tier_idx, req_context.req_id)] = QueuedPromotion(req_context)
        queued.keys.append(key)
        queued.block_ids.append(int(reserved.store_spec.block_ids[0]))
        self.gates[tier_idx].queued(1)
        return None

    def _drop_queued_promotions(self) -> None:
        self._trials.clear()
        for (tier_idx, _), queued in self._promotions.items():
            self.gates[tier_idx].queued(-len(queued.keys))
            self.promotion_rows.held -= len(queued.keys)
            for key in queued.keys:
                self._pending.keys.pop(key, None)
            self.primary_tier.complete_write(queued.keys, queued.req_context, success=False)
        self._promotions.clear()

    def _submit(
        self,
        tier_idx: int,
        keys: list[OffloadKey],
        block_ids: np.ndarray,
        is_promotion: bool,
        req_context: ReqContext,
        queued_at: float = 0.0,
    ) -> None:
        job_id = next(self._job_ids)
        seconds = self._deadlines.seconds
        due = self._deadlines.clock() + seconds if seconds is not None else float("inf")
        self._jobs[job_id] = Job(keys, block_ids.tolist(), is_promotion, req_context, tier_idx, queued_at, due)
        tier = self.secondary_tiers[tier_idx]
        job = JobMetadata(job_id, keys, block_ids, is_promotion, req_context)
        try:
            if is_promotion:
                tier.submit_load(job)
            else:
                tier.submit_store(job)
        except Exception:
            logger.exception("tier %s: job %d rejected; counted as failed", tier.tier_type, job_id)
            self._finish(job_id, success=False)

    def _process_finished(self) -> None:
        self._polled_this_step = True
        polling = self._polling
        if polling.doorbell.rung:
            polling.doorbell.rung = False  # before polling: a ring from now on is seen next time
            self._poll(polling.ringing)
        if polling.every_step:
            self._poll(polling.every_step)

    def _poll(self, tiers: list[Polled]) -> None:
        """Apply what each (index, tier, has `take_released_jobs`) reports."""
        for tier_idx, tier, releases in tiers:
            try:  # `guarded`'s work, inline: this runs every step, and an empty answer is the rule
                results = tier.get_finished()
                results = list(results) if results else []
            except Exception:
                logger.exception("tier %s: get_finished failed", tier.tier_type)
                results = []
            if results and self._deadlines.unresponsive:
                self._deadlines.unresponsive.discard(tier_idx)
            for result in results:
                if result.job_id not in self._jobs and (tier_idx, result.job_id) in self._held:
                    if not result.rows_in_use:  # failed at its deadline; now its I/O is over
                        self._release(self._held.pop((tier_idx, result.job_id)))
                    continue
                self._finish(result.job_id, result.success, tier_idx if result.rows_in_use else None)
            if releases:
                for job_id in guarded(tier, "take_released_jobs", []):
                    job = self._held.pop((tier_idx, job_id), None)
                    if job is not None:
                        self._release(job)

    def _finish(self, job_id: JobId, success: bool, held_by: int | None = None) -> None:
        """Apply a job's end to the primary tier. `held_by`: the index of the tier whose late
        I/O may still use the job's rows; they stay out of use until it releases them."""
        job = self._jobs.pop(job_id, None)
        primary = self.primary_tier
        self._primary_changed = True
        if job is not None and job.is_promotion:
            self.promotion_rows.held -= len(job.keys)
            if self._pending.keys:
                for key in job.keys:
                    self._pending.keys.pop(key, None)
            seconds = time.perf_counter() - job.queued_at
            self.gates[job.tier_idx].finished(len(job.keys), success and not job.voided, seconds)
        if job is None:
            logger.warning("job %d reported again or never submitted; ignored", job_id)
        elif held_by is not None and not success:
            if job.is_promotion and not job.voided:
                job.rows = primary.quarantine_writes(job.keys, job.req_context)
            self._held[(held_by, job_id)] = job  # a cascade's rows stay pinned meanwhile
        elif job.voided:
            self._release(job)
        elif job.is_promotion:
            promoted = primary.complete_write(job.keys, job.req_context, success)
            self._remember_sources(promoted, job.tier_idx)
            if promoted:
                self._promotion_seconds.observe(time.perf_counter() - job.queued_at)
                if self._timeline is not None:
                    self._timeline.promoted(job.req_context.req_id, self.tier_names[job.tier_idx])
        else:
            self._end_cascade(job, success)

    def _expire_overdue(self) -> None:
        """Fail the jobs past their deadline (see the module docstring), oldest first: jobs
        are kept in submission order, so the scan stops at the first one not due."""
        now = self._deadlines.clock()
        while self._jobs:
            job_id, job = next(iter(self._jobs.items()))
            if job.due > now:
                return
            self._counters["jobs_expired"] += 1
            self._deadlines.unresponsive.add(job.tier_idx)
            logger.error(
                "tier %s: %s job %d not reported %.0f s after its submission; failed here, its rows held until "
                "the tier reports it, and nothing promoted from the tier until it reports again",
                self.tier_names[job.tier_idx],
                "load" if job.is_promotion else "store",
                job_id,
                self._deadlines.seconds,
            )
            self._finish(job_id, success=False, held_by=job.tier_idx)

    def _release(self, job: Job) -> None:
        """End a job whose rows were held past its report: free its rows (a promotion, or
        any job voided by `reset_cache`), or unpin them (a failed cascade)."""
        self._primary_changed = True
        if job.is_promotion or job.voided:
            self.primary_tier.release_rows(job.rows)
        if not job.is_promotion:
            if job.voided:
                self.admission[job.tier_idx].finished(job.keys, success=False)
            else:
                self._end_cascade(job, success=False)

    def _write_back(self, tier_idx: int, admission: TierAdmission) -> None:
        """Copy the primary tier's coldest blocks that the write-back tier lacks."""
        ref_count = self.primary_tier.ref_count
        coldest = self.primary_tier.coldest(admission.writeback_window)
        candidates = admission.writeback_candidates(coldest, lambda key: ref_count(key) == 0)
        self._cascade([tier_idx], admission.admit(candidates), _BACKGROUND)
        admission.forget(lambda key: ref_count(key) is not None)

    def _readable(self, key: OffloadKey) -> bool:
        """Whether `key` is resident in the primary tier and not being written."""
        ref_count = self.primary_tier.ref_count(key)
        return ref_count is not None and ref_count >= 0

    def _cascade_to_all(self, cascades: list[tuple[int, list[OffloadKey]]], req_context: ReqContext) -> None:
        """`_cascade` for each (tier, admitted keys); when every tier took the same keys (the
        usual case) their rows are pinned in one pass."""
        if len(cascades) > 1 and all(keys == cascades[0][1] for _, keys in cascades):
            self._cascade([tier_idx for tier_idx, _ in cascades], cascades[0][1], req_context)
        else:
            for tier_idx, keys in cascades:
                self._cascade([tier_idx], keys, req_context)

    def _cascade(self, tier_idxs: list[int], keys: list[OffloadKey], req_context: ReqContext) -> None:
        """Copy `keys` (resident, admitted) to each tier of `tier_idxs`: their rows are pinned
        once, one reader per tier, and stay pinned until every tier reports."""
        if keys:
            spec = self.primary_tier.prepare_read(keys, req_context, readers=len(tier_idxs))
            for tier_idx in tier_idxs:
                self._submit(tier_idx, keys, spec.block_ids, False, req_context)
            self._counters["cascades_submitted"] += len(tier_idxs)

    def _end_cascade(self, job: Job, success: bool) -> None:
        self.primary_tier.complete_read(job.keys, job.req_context)
        self.admission[job.tier_idx].finished(job.keys, success)
