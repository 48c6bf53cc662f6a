"""`ExampleSecondaryTierManager`: the smallest complete secondary tier (type ``"example"``).

It remembers which keys it holds, copies no bytes, and finishes every job at once; the
results come out of the next `get_finished`. It is the reference for writing a tier and a
stand-in for a real one when testing the manager's bookkeeping.

Thread: the scheduler thread only (it does no I/O).
"""

from __future__ import annotations

import logging
from typing import Any

from tiering.contract.keys import OffloadKey, ReqContext
from tiering.tiers.base import Doorbell, JobMetadata, JobResult, SecondaryTierManager

logger = logging.getLogger(f"tiering.{__name__}")  # one logger tree: "tiering"


class ExampleSecondaryTierManager(SecondaryTierManager):
    """An in-memory tier of keys only, with immediate completion. Scheduler thread only."""

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str = "example",
        custom_param: int = 0,
    ):
        """
        Args:
            offloading_spec: the building spec, or None.
            primary_kv_view: the primary rows (unused: this tier copies nothing).
            tier_type: the registered type name.
            custom_param: shows how a tier takes its own options from the config.
        """
        super().__init__(offloading_spec, primary_kv_view, tier_type)
        self.custom_param = custom_param
        self.blocks: dict[OffloadKey, bool] = {}
        self.completed_jobs: list[JobResult] = []
        self.doorbell = Doorbell()
        logger.info("example tier ready (custom_param=%d)", custom_param)

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        """True if the key was stored here, else False; never in flight."""
        return key in self.blocks

    def submit_store(self, job_metadata: JobMetadata) -> None:
        """Record the job's keys as held; the job succeeds.

        Raises:
            ValueError: the job has not one block id per key.
        """
        _check_lengths(job_metadata)
        self.blocks.update(dict.fromkeys(job_metadata.keys, True))
        self.completed_jobs.append(JobResult(job_metadata.job_id, True))
        self.doorbell.ring()

    def submit_load(self, job_metadata: JobMetadata) -> None:
        """Succeed if every key of the job is held, else fail.

        Raises:
            ValueError: the job has not one block id per key.
        """
        _check_lengths(job_metadata)
        success = all(key in self.blocks for key in job_metadata.keys)
        self.completed_jobs.append(JobResult(job_metadata.job_id, success))
        self.doorbell.ring()

    def new_generation(self, weight_version: str | None = None) -> None:
        """A reset: forget every key (none was stored before it, as far as lookups go),
        whatever the weights."""
        self.blocks.clear()

    def attach_doorbell(self, doorbell: Doorbell) -> None:
        """Ring the manager's `doorbell` on every job submitted, so that idle steps skip this tier."""
        self.doorbell = doorbell
        doorbell.ring()

    def get_finished(self) -> list[JobResult]:
        """Results since the last call."""
        finished, self.completed_jobs = self.completed_jobs, []
        return finished

    def get_stats(self) -> dict[str, Any]:
        return {"counters": {}, "gauges": {"blocks": len(self.blocks)}}

    def get_num_blocks(self) -> int:
        """Number of keys held."""
        return len(self.blocks)


def _check_lengths(job: JobMetadata) -> None:
    if len(job.keys) != len(job.block_ids):
        raise ValueError(f"job {job.job_id}: {len(job.keys)} keys but {len(job.block_ids)} block ids")
