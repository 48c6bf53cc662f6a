"""`Cascades`: the primary tier's blocks copied to the secondary tiers.

A block stored from the GPU is cascaded at once, as one store job per tier; the cascade
holds one read reference on each block's row until the last of its tiers reports. Each
tier's `TierAdmission` decides which blocks it gets (a bound on the rows it pins, shedding
while it is behind, a reuse filter); the others stay in the primary tier only, or wait for
room and go at a step's end. A write-back tier gets the primary tier's coldest blocks
instead, at the end of a step that changed the primary tier. A request's retention hint
writes its blocks to a tier that lacks them where the retention is long enough
(`AdmissionConfig.retained_write_s`).

Thread: the scheduler thread only (owned by `TieringOffloadingManager`).
"""

from __future__ import annotations

from collections.abc import Sequence

from tiering.contract.keys import OffloadKey, ReqContext
from tiering.cpu.primary import CPUPrimaryTierOffloadingManager
from tiering.engine.admission import AdmissionConfig, TierAdmission
from tiering.engine.jobs import Job, JobTable
from tiering.engine.tier_calls import Hooks, guarded
from tiering.eviction.retention import RetentionHint

BACKGROUND = ReqContext("background")
"""The request of cascades no request waits on: write-backs, deferred ones, a stop's drain."""


class Cascades:
    """The cascades of one engine: per secondary tier, its admission and the store jobs."""

    def __init__(
        self,
        primary: CPUPrimaryTierOffloadingManager,
        num_tiers: int,
        admission: Sequence[AdmissionConfig | None] | None,
        hooks: Hooks,
        jobs: JobTable,
    ):
        """`admission`: per tier, in order, its config (None, or a shorter list: the
        defaults); `jobs`: where store jobs are sent.

        Raises:
            ValueError: more admission configs than tiers.
        """
        configs = list(admission or ())
        if len(configs) > num_tiers:
            raise ValueError(f"{len(configs)} admission configs for {num_tiers} secondary tiers")
        configs += [None] * (num_tiers - len(configs))
        rows, tiers = primary.num_blocks, max(1, num_tiers)
        self.admission = [TierAdmission(config or AdmissionConfig(), rows, tiers) for config in configs]
        self._primary = primary
        self._jobs = jobs
        self._retaining = hooks["retain"]
        self._releasing = hooks["release"]
        self.write_back_tiers = [idx for idx, admission in enumerate(self.admission) if admission.write_back]
        self.waiting_tiers: set[int] = set()  # tiers with cascades waiting for room
        self.submitted = 0

    @property
    def hinted_tiers(self) -> bool:
        """Whether a tier takes retention hints (has a ``retain`` or ``release`` hook)."""
        return bool(self._retaining or self._releasing)

    def stored(self, keys: list[OffloadKey], req_context: ReqContext) -> None:
        """Cascade blocks just stored from the GPU (resident, readable) to every tier that
        admits them; write-back tiers only count them."""
        cascades = []
        for tier_idx, admission in enumerate(self.admission):
            if admission.counts_reuse:
                admission.stored(keys)
            if not admission.write_back:
                cascades.append((tier_idx, admission.admit(keys)))
                if admission.waiting:
                    self.waiting_tiers.add(tier_idx)
        if len(cascades) > 1 and all(len(admitted) == len(keys) for _, admitted in cascades):  # (each takes all)
            self._cascade([tier_idx for tier_idx, _ in cascades], keys, req_context)  # rows pinned once
        else:
            for tier_idx, admitted in cascades:
                self._cascade([tier_idx], admitted, req_context)

    def on_schedule_end(self, primary_changed: bool) -> None:
        """Write back (if the primary tier's blocks, their order or their readers may have
        changed since the last scan: one that found nothing finds nothing again), then send
        the cascades that waited for room."""
        if primary_changed:
            for tier_idx in self.write_back_tiers:
                self._write_back(tier_idx, self.admission[tier_idx])
        if self.waiting_tiers:
            for tier_idx in list(self.waiting_tiers):
                admission = self.admission[tier_idx]
                self._cascade([tier_idx], admission.admit_waiting(self._readable), BACKGROUND)
                if not admission.waiting:
                    self.waiting_tiers.discard(tier_idx)

    def hinted(self, hint: RetentionHint, blocks: dict[OffloadKey, bool], req_context: ReqContext) -> None:
        """Pass a finished request's hint on: release the blocks it did not find (it stored
        them: its own) and retain all of them, in every tier with those hooks; blocks a tier
        lacks are written to it where its admission says the retention is long enough, and
        retained there too. `blocks`: the request's keys -> whether its lookup found them."""
        if hint.release:
            own = [key for key, found in blocks.items() if not found]
            for _, tier in self._releasing:
                guarded(tier, "release", None, own)
        if hint.retain_s is None:
            return
        keys = list(blocks)
        for tier_idx, tier in self._retaining:
            missing = guarded(tier, "retain", (), keys, hint.retain_s)
            if missing:
                readable = [key for key in missing if self._readable(key)]
                written = self.admission[tier_idx].admit_retained(readable, hint.retain_s)
                self._cascade([tier_idx], written, req_context)
                if written:
                    guarded(tier, "retain", (), written, hint.retain_s)

    def ended(self, job: Job, success: bool, held: bool) -> None:
        """A store job was reported (`JobOwner.ended`): over, unless its tier's late I/O may
        still read the rows (`held`: they stay pinned until `released`)."""
        if not held:
            self._over(job, success)

    def released(self, job: Job) -> None:
        """A held store job's late I/O returned: the job is over, failed."""
        self._over(job, False)

    def _over(self, job: Job, success: bool) -> None:
        """A store job's I/O is over: the cascade's last one unpins its rows; a voided one's
        rows were emptied by `reset_cache`, and are freed."""
        if job.voided:
            self._primary.release_rows(job.rows)
        self.admission[job.tier_idx].finished(job.keys, success and not job.voided)
        pin = job.pin
        assert pin is not None  # (every store job has one)
        pin.jobs_left -= 1
        if not pin.jobs_left and not job.voided:  # (a job that ends after a reset is voided)
            self._primary.complete_read(pin.reading)

    def tier_stats(self, tier_idx: int) -> tuple[dict[str, int], dict[str, int]]:
        """The tier's admission counters and its ``rows_in_flight`` and ``cascades_waiting``
        gauges, for `get_stats`."""
        admission = self.admission[tier_idx]
        gauges = {"rows_in_flight": admission.rows_in_flight, "cascades_waiting": len(admission.waiting)}
        return admission.counters, gauges

    def _write_back(self, tier_idx: int, admission: TierAdmission) -> None:
        """Copy the primary tier's coldest blocks that the write-back tier lacks."""
        ref_count = self._primary.ref_count
        coldest = self._primary.coldest(admission.writeback_window)
        candidates = admission.writeback_candidates(coldest, lambda key: ref_count(key) == 0)
        self._cascade([tier_idx], admission.admit(candidates), BACKGROUND)
        admission.forget(lambda key: ref_count(key) is not None)

    def write(self, tier_idx: int, keys: list[OffloadKey]) -> None:
        """Copy `keys` (resident, readable) to tier `tier_idx` past its admission's rules,
        counted in flight like any cascade (`tiering.engine.drain`)."""
        self._cascade([tier_idx], self.admission[tier_idx].forced(keys), BACKGROUND)

    def _readable(self, key: OffloadKey) -> bool:
        """Whether `key` is resident in the primary tier and not being written."""
        ref_count = self._primary.ref_count(key)
        return ref_count is not None and ref_count >= 0

    def _cascade(self, tier_idxs: list[int], keys: list[OffloadKey], req_context: ReqContext) -> None:
        """Copy `keys` (resident, admitted) to each tier of `tier_idxs`: their rows are pinned
        once for all of them, until every tier reports."""
        if keys:
            reading = self._primary.prepare_read(keys, req_context, readers=len(tier_idxs))
            self._jobs.submit_store(self, tier_idxs, keys, reading, req_context)
            self.submitted += len(tier_idxs)
