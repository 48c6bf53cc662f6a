"""Test doubles that implement the real contracts (no mocking of the code under test)."""

from __future__ import annotations

import fcntl
import os
import threading
import uuid
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from tiering import (
    CPUPrimaryTierOffloadingManager,
    JobMetadata,
    JobResult,
    OffloadKey,
    ReqContext,
    SecondaryTierFactory,
    SecondaryTierManager,
    SharedOffloadRegion,
    TieringOffloadingManager,
    make_offload_key,
)

RUN = uuid.uuid4().hex[:8]
"""This test run's mark in the names of the regions its tests make (`region_name`)."""


def region_name() -> str:
    """A fresh region (engine instance) name of this test run: ``test-<RUN>-<12 hex>``."""
    return f"test-{RUN}-{uuid.uuid4().hex[:12]}"


def engine_regions() -> set[Path]:
    """The engine regions in /dev/shm now, any engine's."""
    return set(Path("/dev/shm").glob("tiering-*"))


def regions_left_behind(before: set[Path]) -> list[Path]:
    """Regions that appeared since `before` and are ours: mapped by this process, or held by
    no process at all (released without being removed) and named by this run (`region_name`,
    also as vLLM's ``engine_id`` of the engines a test starts, or a benchmark engine of this
    process, ``bench-<pid>``). A live engine elsewhere on the machine holds its region's lock,
    and another test run's abandoned regions bear another mark: neither is counted."""
    with open("/proc/self/maps") as maps:
        mapped = maps.read()

    def ours(path: Path) -> bool:
        return f"-{RUN}-" in path.name or path.name.endswith(f"-{os.getpid()}.kv")

    return sorted(
        path for path in engine_regions() - before if str(path) in mapped or (ours(path) and _abandoned(path))
    )


def _abandoned(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # gone meanwhile, or another user's
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


@contextmanager
def one_drain(runtime) -> Iterator[None]:
    """Hold `runtime`'s loop thread in a callback while the block runs: what the block
    submits runs after it, in the same drain of the inbox (as one step's jobs do when the
    loop is idle; a polling loop could otherwise take the first of them alone)."""
    entered, gate = threading.Event(), threading.Event()
    runtime.submit(lambda: (entered.set(), gate.wait(30)))
    runtime.flush()
    assert entered.wait(30)
    try:
        yield
    finally:
        gate.set()


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


class ManualClock:
    """Seconds, monotonic, that move only when a test moves them (``clock.now += 5``)."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


ROW = 4096  # bytes of one primary row in the engine tests
CTX = ReqContext("req-0")


class Engine:
    """A manager over `num_blocks` primary rows and one tier built from `config` (with KV
    events, `events`), built once the tier has indexed what its store held (`recovered`)."""

    def __init__(
        self,
        config,
        num_blocks=4,
        spec=None,
        admission=None,
        tenants=None,
        reset_scope="all",
        events=False,
        recovered=True,
    ):
        region = SharedOffloadRegion(region_name(), num_blocks, ROW)  # page-aligned rows
        self.primary = CPUPrimaryTierOffloadingManager(num_blocks, region, tenants=tenants, enable_events=events)
        self.rows = np.asarray(self.primary.get_kv_memoryview())
        try:
            self.tier = SecondaryTierFactory.create_secondary_tier(config, self.primary.get_kv_memoryview(), spec)
        except BaseException:
            self.primary.shutdown()
            raise
        if recovered and hasattr(self.tier, "wait_recovered"):  # what the store held is indexed, as before any step
            assert self.tier.wait_recovered(30)
        self.manager = TieringOffloadingManager(
            self.primary, [self.tier], admission=admission, reset_scope=reset_scope, enable_events=events
        )

    def store(self, *ids, ctx=CTX):
        """Store blocks as the GPU would (rows filled with their bytes) for the request of
        `ctx`, then let the cascade land."""
        out = self.manager.prepare_store(keys(*ids), ctx)
        for k, row in zip(out.keys_to_store, out.store_spec.block_ids, strict=True):
            self.rows[row] = np.frombuffer(block_bytes(k, ROW), dtype=self.rows.dtype)
        self.manager.complete_store(out.keys_to_store, ctx)
        self.settle()
        return out

    def settle(self):
        assert self.tier.drain(10)
        self.manager.on_schedule_end()

    def lookup_until_done(self, *ids, steps=5):
        for _ in range(steps):
            answers = [self.manager.lookup(k, CTX) for k in keys(*ids)]
            self.settle()
            if None not in answers:
                return answers
        raise AssertionError(f"still in flight after {steps} steps")

    def loaded_bytes(self, *ids):
        spec = self.manager.prepare_load(keys(*ids), CTX)
        data = [self.rows[row].tobytes() for row in spec.block_ids]
        self.manager.complete_load(keys(*ids), CTX)
        return data

    def close(self):
        self.manager.shutdown()


def metrics_text(manager) -> str:
    """What Prometheus would scrape from `manager`'s stats now."""
    from prometheus_client import generate_latest

    from tiering.engine.metrics import PrometheusExporter

    exporter = PrometheusExporter(0)
    try:
        exporter.publish(manager.get_stats())
        return generate_latest(exporter.registry).decode()
    finally:
        exporter.close()
