"""Test doubles that implement the real contracts (no mocking of the code under test)."""

from __future__ import annotations

from collections.abc import Collection

from tiering import (
    JobMetadata,
    JobResult,
    OffloadKey,
    ReqContext,
    SecondaryTierManager,
    make_offload_key,
)


def key(i: int, group: int = 0) -> OffloadKey:
    """A deterministic key for block number `i`."""
    return make_offload_key(i.to_bytes(8, "big"), group)


def keys(*ids: int) -> list[OffloadKey]:
    return [key(i) for i in ids]


class RegionStandIn:
    """A primary-tier region backed by a bytearray, counting the calls the primary makes."""

    def __init__(self, num_blocks: int, row_bytes: int = 16, log: list[str] | None = None):
        self.buffer = bytearray(num_blocks * row_bytes)
        self.shape = (num_blocks, row_bytes)
        self.views_created = 0
        self.cleanups = 0
        self.log = log if log is not None else []

    def create_kv_memoryview(self) -> memoryview:
        self.views_created += 1
        return memoryview(self.buffer).cast("B", self.shape)

    def cleanup(self) -> None:
        self.cleanups += 1
        self.log.append("region.cleanup")


class ManualTier(SecondaryTierManager):
    """A tier whose jobs finish only when the test says so.

    `present` maps keys to the lookup answer (True, or None for "in flight"); every
    submitted job waits in `pending` until `finish` reports it. On shutdown it reports its
    pending jobs as failed, as the contract requires.
    """

    def __init__(self, name: str = "manual", log: list[str] | None = None):
        super().__init__(None, memoryview(b""), name)
        self.present: dict[OffloadKey, bool | None] = {}
        self.pending: dict[int, JobMetadata] = {}
        self.submitted: list[JobMetadata] = []
        self.results: list[JobResult] = []
        self.touched: list[list[OffloadKey]] = []
        self.polls = 0
        self.drains = 0
        self.log = log if log is not None else []

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        return self.present.get(key, False)

    def submit_store(self, job_metadata: JobMetadata) -> None:
        self.submitted.append(job_metadata)
        self.pending[job_metadata.job_id] = job_metadata

    def submit_load(self, job_metadata: JobMetadata) -> None:
        self.submitted.append(job_metadata)
        self.pending[job_metadata.job_id] = job_metadata

    def finish(self, job_id: int | None = None, success: bool = True) -> JobMetadata:
        """Report one pending job (the oldest by default); a stored job's keys become present."""
        job = self.pending.pop(next(iter(self.pending)) if job_id is None else job_id)
        if success and not job.is_promotion:
            self.present.update(dict.fromkeys(job.keys, True))
        self.results.append(JobResult(job.job_id, success))
        return job

    def finish_all(self, success: bool = True) -> None:
        while self.pending:
            self.finish(success=success)

    def get_finished(self) -> list[JobResult]:
        self.polls += 1
        results, self.results = self.results, []
        return results

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.touched.append(list(keys))

    def has_pending_work(self) -> bool:
        return bool(self.pending)

    def drain(self, timeout_s: float | None = None) -> bool:
        self.drains += 1
        self.finish_all()
        return True

    def shutdown(self) -> None:
        self.log.append(f"{self.tier_type}.shutdown")
        self.finish_all(success=False)


def block_bytes(key: OffloadKey, size: int) -> bytes:
    """Deterministic pseudo-random content of a block, a function of its key."""
    import hashlib

    seed = hashlib.blake2b(key, digest_size=8).digest()
    out = bytearray()
    counter = 0
    while len(out) < size:
        out += hashlib.blake2b(seed + counter.to_bytes(8, "big"), digest_size=64).digest()
        counter += 1
    return bytes(out[:size])
