"""`JobTable`: the jobs the engine submitted to its secondary tiers, until each ends.

A job is one tier's store (a cascade) or load (a promotion) of a request's blocks. The
table submits it, hears of it ending (a tier that rings the `Doorbell` is polled only after
a ring, so an idle step asks no tier anything) and reports each end to the job's owner
(`JobOwner`: `Cascades` for stores, `Promotions` for loads). A tier
that raises is logged and its job counted as failed; no backend exception reaches the
scheduler.

A job its tier has not reported ``job_deadline_s`` after its submission fails here
(``jobs_expired``) and is held, its rows out of use, until the tier reports it after all
(its I/O may still use them). Until the tier reports any job again, it is `unresponsive`:
the engine promotes nothing from it, so a tier with a bug, or whose event loop died,
strands no request.

Thread: the scheduler thread only (owned by `TieringOffloadingManager`).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from tiering.contract.keys import OffloadKey, ReqContext
from tiering.cpu.readers import Reading
from tiering.engine.tier_calls import Hooks, attached, guarded
from tiering.tiers.base import Doorbell, JobId, JobMetadata, SecondaryTierManager

logger = logging.getLogger(__name__)

JOB_DEADLINE_S = 120.0
"""Seconds a secondary tier has to report a job before the manager fails it (four of a block
store's ``op_timeout_s``: a tier whose calls time out reports long before)."""


class CascadePin:
    """The primary rows of a cascade to several tiers, pinned once for all of its store jobs
    (`reading`): `jobs_left` counts those not ended yet; the last one to end unpins the rows."""

    __slots__ = ("jobs_left", "reading")

    def __init__(self, jobs: int, reading: Reading):
        self.jobs_left = jobs
        self.reading = reading


class JobOwner(Protocol):
    """Who submitted a job and hears of its end (scheduler thread)."""

    def ended(self, job: Job, success: bool, held: bool) -> None:
        """The tier reported `job` (or it failed at its deadline). `held`: it failed while
        its I/O may still use the rows; `released` follows once that I/O is over."""

    def released(self, job: Job) -> None:
        """A held job's I/O is over: its rows are the engine's again."""


@dataclass(slots=True)
class Job:
    """A job submitted to a secondary tier and not reported yet (or held past its report)."""

    keys: list[OffloadKey]
    rows: list[int]  # the primary rows its I/O reads (a cascade) or writes (a promotion)
    is_promotion: bool
    req_context: ReqContext
    tier_idx: int
    due: float  # the job fails here after this (`JobTable.clock` seconds)
    owner: JobOwner  # hears of its end
    queued_at: float = 0.0  # a promotion's first lookup, perf_counter seconds (unused for cascades)
    pin: CascadePin | None = None  # a cascade's, shared by its jobs (None for a promotion)
    voided: bool = False  # by reset_cache: its keys are gone and its rows held until it ends


Polled = tuple[int, SecondaryTierManager, bool]  # (tier index, tier, has `take_released_jobs`)


class JobTable:
    """Jobs in flight (`jobs`, in submission order) and held past their report (`held`).

    Each job's end goes to its owner (`JobOwner.ended`, then `JobOwner.released` for a held
    one); `changed` turns True at each (the owner's rows, readers or blocks may have
    changed), for the manager to reset.
    """

    def __init__(
        self,
        tiers: Sequence[SecondaryTierManager],
        tier_names: list[str],
        hooks: Hooks,
        deadline_s: float | None,
        clock: Callable[[], float],
    ):
        """
        Args:
            tiers, tier_names: the secondary tiers, in order, and their names (for logs).
            hooks: which tiers implement the optional hooks (`tier_calls.hooks_of`).
            deadline_s: seconds a tier has to report a job; None: no deadline.
            clock: seconds, monotonic: when jobs are due.
        """
        self._tiers = tiers
        self._tier_names = tier_names
        self.changed = False
        self.deadline_s = deadline_s
        self.clock = clock
        self._ids = itertools.count()
        self.jobs: dict[JobId, Job] = {}
        self.held: dict[tuple[int, JobId], Job] = {}  # jobs whose late I/O still uses their rows
        self.unresponsive: set[int] = set()  # tiers with an expired job, until they report again
        self.expired = 0
        self.doorbell = Doorbell()
        ringing = {
            idx
            for idx, tier in hooks["attach_doorbell"]
            if attached(tier, "attach_doorbell", self.doorbell, "it is polled every step")
        }
        releasing = {idx for idx, _ in hooks["take_released_jobs"]}
        polled = [(idx, tier, idx in releasing) for idx, tier in enumerate(tiers)]
        self._ringing = [entry for entry in polled if entry[0] in ringing]
        self.every_step = [entry for entry in polled if entry[0] not in ringing]

    def submit_store(
        self, owner: JobOwner, tier_idxs: list[int], keys: list[OffloadKey], reading: Reading, req_context: ReqContext
    ) -> None:
        """Send a store job of `keys` (a cascade) to each tier of `tier_idxs`; their primary
        rows, `reading` (`CPUPrimaryTierOffloadingManager.prepare_read`), were pinned once for
        all of them (their jobs share a `CascadePin`). Scheduler thread; never raises: a job
        the tier rejects (raises) ends failed at once."""
        due, pin = self._due(), CascadePin(len(tier_idxs), reading)
        for tier_idx in tier_idxs:
            self._send(Job(keys, reading.rows, False, req_context, tier_idx, due, owner, pin=pin), reading.block_ids)

    def submit_load(
        self,
        owner: JobOwner,
        tier_idx: int,
        keys: list[OffloadKey],
        block_ids: np.ndarray,
        req_context: ReqContext,
        queued_at: float,
    ) -> None:
        """Send a load job of `keys` (a promotion) to tier `tier_idx`, into the primary rows
        `block_ids` (1-D int64, one per key, in order). `queued_at`: the promotion's first
        lookup, `time.perf_counter` seconds. Scheduler thread; never raises, as `submit_store`."""
        job = Job(keys, block_ids.tolist(), True, req_context, tier_idx, self._due(), owner, queued_at)
        self._send(job, block_ids)

    def _due(self) -> float:
        return self.clock() + self.deadline_s if self.deadline_s is not None else float("inf")

    def _send(self, job: Job, block_ids: np.ndarray) -> None:
        job_id = next(self._ids)
        self.jobs[job_id] = job
        tier = self._tiers[job.tier_idx]
        metadata = JobMetadata(job_id, job.keys, block_ids, job.is_promotion, job.req_context)
        try:
            if job.is_promotion:
                tier.submit_load(metadata)
            else:
                tier.submit_store(metadata)
        except Exception:
            logger.exception("tier %s: job %d rejected; counted as failed", tier.tier_type, job_id)
            self._finish(job_id, success=False)

    def poll(self) -> None:
        """Hear of the jobs that ended: the ringing tiers after a ring, the others always."""
        if self.doorbell.rung:
            self.doorbell.rung = False  # before polling: a ring from now on is seen next time
            self._poll(self._ringing)
        if self.every_step:
            self._poll(self.every_step)

    def _poll(self, tiers: list[Polled]) -> None:
        """Apply what each (index, tier, has `take_released_jobs`) reports."""
        for tier_idx, tier, releases in tiers:
            try:  # `guarded`'s work, inline: this runs every step, and an empty answer is the rule
                results = tier.get_finished()
                results = list(results) if results else []
            except Exception:
                logger.exception("tier %s: get_finished failed", tier.tier_type)
                results = []
            if results and self.unresponsive:
                self.unresponsive.discard(tier_idx)
            for result in results:
                if result.job_id not in self.jobs and (tier_idx, result.job_id) in self.held:
                    if not result.rows_in_use:  # failed at its deadline; now its I/O is over
                        self._release(self.held.pop((tier_idx, result.job_id)))
                    continue
                self._finish(result.job_id, result.success, tier_idx if result.rows_in_use else None)
            if releases:
                for job_id in guarded(tier, "take_released_jobs", []):
                    job = self.held.pop((tier_idx, job_id), None)
                    if job is not None:
                        self._release(job)

    def _finish(self, job_id: JobId, success: bool, held_by: int | None = None) -> None:
        """End a job. `held_by`: the index of the tier whose late I/O may still use the
        job's rows; a failed job's are held until it releases them."""
        job = self.jobs.pop(job_id, None)
        if job is None:
            logger.warning("job %d reported again or never submitted; ignored", job_id)
            return
        held = False
        if held_by is not None and not success:
            self.held[(held_by, job_id)] = job
            held = True
        self.changed = True
        job.owner.ended(job, success, held)

    def _release(self, job: Job) -> None:
        self.changed = True
        job.owner.released(job)

    def expire_overdue(self) -> None:
        """Fail the jobs past their deadline (see the module docstring), oldest first: jobs
        are kept in submission order, so the scan stops at the first one not due."""
        now = self.clock()
        while self.jobs:
            job_id, job = next(iter(self.jobs.items()))
            if job.due > now:
                return
            self.expired += 1
            self.unresponsive.add(job.tier_idx)
            logger.error(
                "tier %s: %s job %d not reported %.0f s after its submission; failed here, its rows held until "
                "the tier reports it, and nothing promoted from the tier until it reports again",
                self._tier_names[job.tier_idx],
                "load" if job.is_promotion else "store",
                job_id,
                self.deadline_s,
            )
            self._finish(job_id, success=False, held_by=job.tier_idx)

    def void(self) -> list[Job]:
        """Void every job whose rows are not quarantined already (`reset_cache`): in flight,
        or a held cascade. Returns those newly voided."""
        in_flight = [*self.jobs.values(), *(job for job in self.held.values() if not job.is_promotion)]
        voided = [job for job in in_flight if not job.voided]
        for job in voided:
            job.voided = True
        return voided
