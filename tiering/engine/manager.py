"""`TieringOffloadingManager`: the primary tier plus secondary tiers behind one manager.

It keeps the `OffloadingManager` contract's methods and composes the engine's parts:

- store path: ``complete_store`` makes blocks loadable in the primary tier and cascades
  them to the secondary tiers at once (`tiering.engine.cascades`);
- load path: a ``lookup`` that misses the primary tier asks the secondary tiers in order;
  the first that has the block, and loads it sooner than the model would recompute it
  (`tiering.engine.recompute`), gets it promoted: a primary row is reserved at once (so a
  second lookup sees the block in flight and queues nothing), the lookup answers None, and
  the step's promotions are submitted at ``on_schedule_end`` (`tiering.engine.promotions`,
  which also bounds the rows promotions may hold). A promotion never evicts a block that a
  lookup of the same step found in the primary tier: a request is about to load it;
- jobs: every cascade and promotion is a job of `tiering.engine.jobs`'s `JobTable`, which
  hears of their ends once before the step's first ``lookup``/``prepare_store`` and once in
  ``on_schedule_end``, and fails a job its tier has not reported by its deadline.

Thread: the scheduler thread only (`shutdown` may block; every other method
returns in microseconds).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

from tiering.contract.identity import check_weight_version
from tiering.contract.keys import OffloadKey, ReqContext, RequestOffloadingContext
from tiering.contract.mediums import CPULoadStoreSpec, OffloadingEvent, PrepareStoreOutput
from tiering.contract.offloading import OffloadingManager
from tiering.cpu.primary import CPUPrimaryTierOffloadingManager
from tiering.engine.admission import AdmissionConfig
from tiering.engine.cascades import Cascades
from tiering.engine.drain import SHUTDOWN_DRAIN_S, drain
from tiering.engine.jobs import JOB_DEADLINE_S, JobTable
from tiering.engine.load_tiers import allowed_tiers, tier_places
from tiering.engine.lookups import RequestLookups
from tiering.engine.promotions import PromotionRows, Promotions
from tiering.engine.tier_calls import guarded, hooks_of, new_generations
from tiering.engine.timeline import RequestTimeline
from tiering.eviction.retention import hint_of
from tiering.stats import Every, RareLog
from tiering.tiers.base import SecondaryTierManager
from tiering.tiers.context import PRIMARY_NAME, unique_names

logger = logging.getLogger(__name__)


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
        reset_scope: str = "all",
        shutdown_drain_s: float = SHUTDOWN_DRAIN_S,
    ):
        """
        Args:
            primary_tier: the CPU tier; the only one that talks to the GPU.
            secondary_tiers: looked up in this order on a primary miss.
            enable_events: return the tiers' events from `take_events` (the secondary tiers'
                too, from their ``enable_events`` hook on).
            admission: per secondary tier, in order, its `AdmissionConfig` (None, or a
                shorter list: the defaults).
            block_tokens: tokens per block, for the token counters of `get_stats`; None
                leaves them out (block counts only).
            recompute_tokens_per_s: the model's prefill rate, prompt tokens per second: a
                block only a tier slower than that holds is a miss (`tiering.engine.recompute`);
                None (or no `block_tokens`): every block found is promoted.
            request_log: a JSON Lines file of a line per finished request (`tiering.engine.timeline`); None: off.
            max_promotion_rows: primary rows that promotions queued or in flight may hold at
                once; None: no cap beyond `store_reserve_rows`.
            store_reserve_rows: rows kept available for the GPU's stores: a promotion takes a
                row only if more than this many are available (free, or idle and evictable)
                when it asks, or if no promotion holds a row (so one always starts). Under
                vLLM, one scheduler step's stores (`tiering.integrations.vllm`).
            job_deadline_s: seconds a secondary tier has to report a job before it fails here; None: none.
            clock: seconds, monotonic: when jobs are due (tests move it by hand).
            reset_scope: ``all``: `reset_cache` also starts new generations of the secondary
                tiers; ``cpu``: they keep their blocks (weights that never change).
            shutdown_drain_s: seconds `shutdown` may spend writing the blocks only the primary
                tier holds to the lasting tiers (`tiering.engine.drain`); 0: none.

        Raises:
            ValueError: more admission configs than tiers, or a tier's medium or locality is not vLLM's (`tier_places`).
            OSError: `request_log` cannot be opened for appending.
        """
        self.primary_tier = primary_tier
        self.secondary_tiers = list(secondary_tiers or ())
        self.reset_scope, self.shutdown_drain_s = reset_scope, shutdown_drain_s
        self.tier_names = unique_names([getattr(tier, "name", tier.tier_type) for tier in self.secondary_tiers])
        self.tier_places = tier_places(self.secondary_tiers, self.tier_names)
        self.block_tokens = block_tokens
        self._enable_events = enable_events
        self._polled_this_step = False
        self._shut_down = False
        # (few attributes: past 30, CPython stops sharing instance dict keys and every attribute read slows)
        self._hooks = hooks_of(self.secondary_tiers)
        for _, tier in self._hooks["enable_events"] if enable_events else ():
            guarded(tier, "enable_events", None)
        self.jobs = JobTable(self.secondary_tiers, self.tier_names, self._hooks, job_deadline_s, clock)
        self.cascades = Cascades(primary_tier, len(self.secondary_tiers), admission, self._hooks, self.jobs)
        self._timeline = RequestTimeline(request_log) if request_log is not None else None
        self.promotions = Promotions(
            primary_tier,
            self.tier_names,
            self.secondary_tiers,
            self._hooks,
            self.jobs,
            PromotionRows(max_promotion_rows or primary_tier.num_blocks, store_reserve_rows),
            recompute_tokens_per_s,
            block_tokens,
            self._timeline,
        )
        self._pending = self.promotions.pending
        self._step_hits: set[OffloadKey] = set()  # found in the primary tier by this step's lookups
        self._requests = RequestLookups(self.promotion_source)
        self._listeners: list[tuple[Callable[[dict[str, Any]], None], Every]] = []
        self._client_warnings = RareLog()  # what clients' requests get wrong (hints, kv_load_tiers): logged rarely
        self._primary_changed = True  # blocks, order or readers changed since the last write-back scan

    # -- scheduler calls ------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        """True if `key` is loadable from the primary tier; None to retry next step (a
        transfer is in flight, a promotion was just queued, or a tier is still unsure);
        False if no tier has it or the primary tier has no room to promote it. With
        `answer_pending_hits`, a block whose promotion is `pending_loadable` is True at once,
        False once that promotion is overdue (`Promotions.early_hit`)."""
        if not self._polled_this_step:
            self._poll_finished()
        answer = self.primary_tier.lookup(key, req_context)
        if answer is False:
            answer = self.promotions.find(key, req_context, self._step_hits)
            if answer is None:
                self._primary_changed = True  # a promotion may have reserved a row
        elif answer:
            self._step_hits.add(key)
        source = None
        if answer is None and self._pending.answer_hits and key in self._pending.keys:
            answer = self.promotions.early_hit(key)  # the worker's load waits for the row
            source = self.promotion_source(key) if answer else None
        self._requests.answered(req_context.req_id, key, answer, source)
        if self._timeline is not None:
            self._timeline.looked_up(req_context.req_id)
        return answer

    def pending_loadable(self, key: OffloadKey) -> bool:
        """Whether `key`'s row is being filled by a promotion whose tier settles the row's state as it
        lands (`tiering.cpu.row_states`): `prepare_load` may pin it now, the worker's load waiting
        for the row (nothing copied if it fails). A caller whose loads wait so (our connector) sets
        `answer_pending_hits`: such lookups answer True. Scheduler thread; never raises."""
        return key in self._pending.keys

    @property
    def answer_pending_hits(self) -> bool:
        """Whether a lookup answers True for a block whose promotion is `pending_loadable` (False by
        default: the seeds' answer None until it lands); set where loads wait for the rows (our connector)."""
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
            self._poll_finished()
        self._requests.stored(req_context.req_id, keys)
        self._primary_changed = True
        return self.primary_tier.prepare_store(keys, req_context)

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        """Finish a GPU store and cascade the newly stored blocks to every secondary tier."""
        self._primary_changed = True
        stored = self.primary_tier.complete_store(keys, req_context, success)
        if not stored:
            return
        self.promotions.forget(stored)
        self.cascades.stored(stored, req_context)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        req_context.load_tiers = allowed_tiers(req_context, self.tier_places, self._client_warnings)
        return self.primary_tier.on_new_request(req_context)

    def on_request_finished(self, req_context: ReqContext) -> None:
        """Forget the request's lookups (see `tiering.engine.lookups`); pass its retention hint to
        every tier (`tiering.eviction.retention`). Its queued promotions still run (other requests
        share prefixes)."""
        blocks = self._requests.finished(req_context.req_id)
        self._primary_changed = True
        self.primary_tier.on_request_finished(req_context)
        if blocks and self.cascades.hinted_tiers:
            primary = self.primary_tier
            logged_there = primary.retention is not None or primary.tenants is not None
            hint = hint_of(req_context, None if logged_there else self._client_warnings)
            if hint is not None:
                self.cascades.hinted(hint, blocks, req_context)
        if self._timeline is not None:
            self._timeline.finished(req_context.req_id)

    def take_events(self) -> list[OffloadingEvent]:
        """Events of the primary tier, then of each secondary tier, since the last call;
        empty unless the manager was built with ``enable_events=True``."""
        events = self.primary_tier.take_events()
        if not self._enable_events:
            return []
        for _, tier in self._hooks["take_events"]:
            events.extend(guarded(tier, "take_events", []))
        return events

    def on_schedule_end(self) -> None:
        """Process finished jobs, submit the step's promotions, write-backs and the cascades
        that waited for room (see `tiering.engine.admission`), then let tiers flush."""
        jobs, promotions, cascades = self.jobs, self.promotions, self.cascades
        if jobs.doorbell.rung or jobs.every_step:
            self._polled_this_step = True
            jobs.poll()
        if jobs.jobs and jobs.deadline_s is not None:
            jobs.expire_overdue()
        if (promotions.queued or promotions.trials) and promotions.on_schedule_end(self._step_hits):
            self._primary_changed = True
        if cascades.waiting_tiers or cascades.write_back_tiers:
            changed, jobs.changed = self._primary_changed or jobs.changed, False  # (a job's end moves rows, readers)
            if cascades.waiting_tiers or changed:
                cascades.on_schedule_end(changed)
        self._primary_changed = False
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
        return self.promotions.source(key)

    def get_stats(self) -> dict[str, Any]:
        """A snapshot of every counter, gauge and histogram; docs/observability.md
        documents each name. Scheduler thread; cheap (no I/O, nothing scanned).

        Returns:
            ``{"primary": stats, "tiers": {name: stats}, "manager": stats}`` (and ``"tenants":
            {name: stats}`` with a ``tenants`` config), each ``stats`` shaped ``{"counters":
            {...}, "gauges": {...}, "histograms": {...}}`` (see `tiering.stats`). ``primary``
            and each tier (by `tier_names`) is its own `get_stats()` plus the lookups counted
            per request (`tiering.engine.lookups`); each secondary tier adds its admission's
            counters and gauges and its `RecomputeGate`'s declines. ``manager`` has the
            request-level counters, the jobs and promotions, and the ``promotion_seconds``
            histogram; ``tenants`` the CPU tier's counters and gauges per tenant.
        """
        requests = self._requests
        primary = self.primary_tier.get_stats()
        primary["counters"].update(self._hit_counters(PRIMARY_NAME))
        tiers = {}
        for tier_idx, (name, tier) in enumerate(zip(self.tier_names, self.secondary_tiers, strict=True)):
            stats = dict(guarded(tier, "get_stats", {}))
            admitted, in_flight = self.cascades.tier_stats(tier_idx)
            stats["counters"] = {
                **stats.get("counters", {}),
                **admitted,
                "promotions_declined": self.promotions.gates[tier_idx].declined,
                **self._hit_counters(name),
            }
            stats["gauges"] = {**stats.get("gauges", {}), **in_flight}
            stats.setdefault("histograms", {})
            tiers[name] = stats
        counters: dict[str, Any] = {
            **self.promotions.counters,
            "cascades_submitted": self.cascades.submitted,
            "jobs_expired": self.jobs.expired,
            "requested_blocks": requests.requested_blocks,
        }
        if self.block_tokens is not None:
            counters["requested_tokens"] = requests.requested_blocks * self.block_tokens
        counters["lookups_repeated"] = requests.lookups_repeated
        counters.update(requests.by_group())
        gauges = {
            "requests_open": len(requests),
            "jobs_in_flight": len(self.jobs.jobs),
            "jobs_holding_rows": len(self.jobs.held),
            **self.promotions.gauges(),
        }
        histograms = {"promotion_seconds": self.promotions.seconds.snapshot()}
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
        self._listeners.append((callback, Every(interval_s, at_once=True)))

    def _publish_stats(self) -> None:
        due = [callback for callback, every in self._listeners if every.due()]
        if due:
            stats = self.get_stats()
            for callback in due:
                try:
                    callback(stats)
                except Exception:
                    logger.exception("stats listener %r failed", callback)

    def has_pending_work(self) -> bool:
        """Whether a promotion is queued or a job has not been reported yet."""
        return bool(self.jobs.jobs or self.promotions.queued)

    def reset_cache(self, weight_version: str | None = None) -> None:
        """Process what finished, drop queued promotions and empty the primary tier (see
        `CPUOffloadingManager.reset_cache`: the caller's transfers started before the reset
        are void, as under vLLM); with ``reset_scope`` ``all``, each secondary tier moves to
        the weights `weight_version` declares (`SecondaryTierManager.new_generation`): a
        lasting tier's namespace of this identity and those weights, shared with every engine
        on them; None: a namespace of this engine's own, shared with none until a restart or
        a declared version. Nothing stored before is offered again unless it was computed
        with the declared weights. Returns at once: it waits for no tier (a frozen one would
        stop vLLM's scheduler loop). A secondary tier's job still in flight is void: its keys are forgotten at once (no
        lookup waits on them), its rows stay out of use until the tier reports it (or, after
        a timeout, releases its late I/O), and it is then counted as failed. So every row
        comes back and nothing is left waiting.

        Raises:
            ValueError: `weight_version` is not 1 to 256 printable characters without blanks.
        """
        check_weight_version(weight_version)
        self._poll_finished()
        self.promotions.drop_queued()
        # Rows of a held promotion are quarantined already; every other job's need a hold.
        voided = self.jobs.void()
        self.primary_tier.reset_cache(keep_rows=[row for job in voided for row in job.rows])
        self._primary_changed = True
        self.promotions.forget()
        if self.reset_scope == "all":
            self.primary_tier.follow_weights(weight_version)
            new_generations(self.secondary_tiers, self.tier_names, weight_version)

    def __enter__(self) -> TieringOffloadingManager:
        """``with TieringOffloadingManager(...) as manager:`` shuts it down on exit."""
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Write the blocks only the primary tier holds to the lasting tiers, for at most
        `shutdown_drain_s` (`tiering.engine.drain`), shut every secondary tier (which reports
        its jobs in flight as failed), release the primary tier and its shared memory. Later
        calls do nothing."""
        if self._shut_down:
            return
        self._shut_down = True
        self.promotions.drop_queued()
        tiers, names = self.secondary_tiers, self.tier_names
        drain(self.primary_tier, tiers, names, self.cascades, self._poll_finished, self.shutdown_drain_s)
        for tier in self.secondary_tiers:
            guarded(tier, "shutdown", None)
        self._poll_finished()
        if self.jobs.jobs:
            logger.warning("%d jobs were never reported by their tiers", len(self.jobs.jobs))
        self.primary_tier.shutdown()
        if self._timeline is not None:
            self._timeline.close()

    # -- internals ------------------------------------------------------------------------

    def _poll_finished(self) -> None:
        self._polled_this_step = True
        self.jobs.poll()
