"""Scheduler-thread cost of each manager call, against a raw-Python baseline in the same run.

The engine is a `TieringOffloadingManager` over a real shared-memory primary tier (its
policy chosen by ``--policy``) with two `example` secondary tiers; each batch of stores is
one request, opened and finished around it as a scheduler does (a policy that learns from
requests pays for it there), with the retention hint of ``--hints`` (`tiering.eviction.retention`:
``retain`` gives every request's blocks a deadline of an hour, ``release`` releases them;
the example tiers keep no deadlines, so this is the CPU tier's and the manager's cost).
The baseline does the least any manager must do for the same call: the dict operations on
plain Python objects, nothing else. Both run interleaved, `--repeats` times, and the fastest
run of each is kept (the machines are shared and noisy); `SURVIVING_ROW` with a crash-surviving CPU tier.

Timed sections run with the garbage collector paused, as `timeit` does: a collection
triggered by an earlier section's garbage would otherwise land in a later one.

A second table gives the cost of an eviction while a fifth of the tier is retained by a
client's hint (``{"retain": "7d"}``, the cap's share, stored first so that it sinks to the
cold end) against the same without hints: per evicting store of one request of ``--batch``
blocks in a CPU tier (LRU) of 200,000 and 1,000,000 rows, and per evicted block in a
secondary tier's index of 100,000 and 1,000,000 blocks. Each run evicts the rest of the tier
once; the table gives the mean of that pass and its worst single call (a CPU tier keeps
retained blocks out of its eviction order; a tier index passes over each retained block once
per pass, `tiering.eviction.retention`); ``--eviction-repeats`` interleaved runs, the best kept.

A third table gives what KV events cost the scheduler thread per block stored (events off
and on, interleaved): a request's store through the manager (the CPU tier's events, taken
every step as vLLM does; the example tiers keep none), and a block-store tier applying a
finished store job of ``--batch`` blocks to its full index of ``--blocks`` (each stored block
evicts one: a stored and a removed announcement per block, taken every job).

A fourth table gives the cost of handing one job to an async tier on the scheduler thread:
`BlockStoreTier.submit_store` of a 16-block job (a slow memory tier, so nothing finishes
meanwhile), against a bare `AsyncRuntime.submit` and against one
`asyncio.run_coroutine_threadsafe` per job to a loop thread.

    python -m tiering.benchmarks.scheduler_cost --blocks 20000 [--policy arc-s] [--hints retain:1h]
        [--eviction-repeats 2] [--eviction-scale 1]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import time
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
from rich.table import Table

from tiering import (
    AsyncRuntime,
    CPUPrimaryTierOffloadingManager,
    JobMetadata,
    OffloadKey,
    ReqContext,
    SecondaryTierFactory,
    SharedOffloadRegion,
    TieringOffloadingManager,
    make_offload_key,
)
from tiering.benchmarks.args import HINTS, checked, parse_hints
from tiering.benchmarks.json_report import add_json_argument, open_report
from tiering.contract.mediums import LOCAL, STORAGE
from tiering.cpu.row_records import Survival
from tiering.eviction.policies import cache_policy_names
from tiering.tiers.blockstore.applying import apply_store
from tiering.tiers.blockstore.counters import TierCounters
from tiering.tiers.blockstore.index import BlockIndex
from tiering.tiers.blockstore.outbox import StoreDone
from tiering.tiers.events import TierEvents

CTX = ReqContext("bench")
RETAINED_FRACTION = 0.2
"""The share of a tier a client's hints may hold (the default ``retention_max_fraction``),
and hold in the eviction rows."""
EVICTION_SIZES = (("CPU tier", 200_000), ("CPU tier", 1_000_000), ("tier index", 100_000), ("tier index", 1_000_000))
"""The eviction table's rows: where, and how many rows or blocks the tier holds."""
EVICTION_WORST = ("worst, no hints (us)", "worst, retained (us)", "worst ratio")
STORE_ROW = "request of a batch: store + complete, per block"
SURVIVING_ROW = "the same, its CPU tier surviving crashes (cpu_tier.survive_crash), per block"


def transfer_params(hints: str) -> dict | None:
    """The ``kv_transfer_params`` every request sends under ``--hints`` (`parse_hints`;
    ``continuation`` needs conversations: `tiering-bench` replays them).

    Raises:
        ValueError: not such a value, or ``continuation``.
    """
    mode, seconds = parse_hints(hints)
    if mode == "continuation":
        raise ValueError("continuation needs conversations: tiering-bench --hints continuation replays them")
    return None if mode == "none" else {"kv_tiering": {"retain": seconds} if mode == "retain" else {"release": True}}


def _keys(start: int, count: int) -> list[OffloadKey]:
    return [make_offload_key(i.to_bytes(16, "big"), 0) for i in range(start, start + count)]


class Engine:
    """One fresh engine: `num_blocks` primary rows under `policy`, two example tiers; with
    `events`, KV events on (taken every step, as vLLM does); with `survive`, a CPU tier that
    outlives a crash (`tiering.cpu.row_records`: each stored row recorded and sealed)."""

    def __init__(self, num_blocks: int, policy: str, events: bool = False, survive: bool = False):
        survival = Survival(bytes(16), keep_on_stop=False) if survive else None
        keep = survival.digest("bench") if survival else None
        self.region = SharedOffloadRegion(f"bench-{os.getpid()}", num_blocks, 64, keep=keep)
        primary = CPUPrimaryTierOffloadingManager(num_blocks, self.region, policy, events, survival=survival)
        view = primary.get_kv_memoryview()
        tiers = [SecondaryTierFactory.create_secondary_tier({"type": "example"}, view, None) for _ in range(2)]
        self.manager = TieringOffloadingManager(primary, tiers, enable_events=events)

    def close(self) -> None:
        self.manager.shutdown()


def time_engine(
    num_blocks: int, batch: int, policy: str, hints: str = "none", events: bool = False, survive: bool = False
) -> dict[str, float]:
    """Seconds per block (store) or per call (the others) of the real engine, its requests
    sending `transfer_params(hints)`, with KV events (`events`: the store row's time includes
    taking them each step), its CPU tier surviving crashes (`survive`)."""
    engine = Engine(num_blocks, policy, events, survive)
    manager, params = engine.manager, transfer_params(hints)
    stored, missing = _keys(0, num_blocks), _keys(num_blocks, num_blocks)
    try:
        elapsed = 0.0
        for i in range(0, num_blocks, batch):
            chunk, request = stored[i : i + batch], ReqContext(f"bench-{i}", kv_transfer_params=params)
            start = time.perf_counter()
            manager.on_new_request(request)
            out = manager.prepare_store(chunk, request)
            assert out is not None  # the tier has a row for every block
            manager.complete_store(out.keys_to_store, request)
            manager.on_request_finished(request)  # the policy learns from the request here
            if events:
                manager.take_events()
            elapsed += time.perf_counter() - start
            manager.on_schedule_end()  # the tiers' results free the cascade references
        results = {STORE_ROW: elapsed / num_blocks}
        results["lookup, primary hit"] = _per_call(manager.lookup, stored)
        results["lookup, miss in every tier"] = _per_call(manager.lookup, missing)
        manager.on_schedule_end()
        results["on_schedule_end, nothing to do"] = _per_call(lambda _key, _ctx: manager.on_schedule_end(), stored)
        return results
    finally:
        engine.close()


def time_baseline(num_blocks: int, batch: int) -> dict[str, float]:
    """The same calls as plain dict work: a status object per row, two dicts of keys."""

    class Status:
        __slots__ = ("block_id", "ref_cnt")

        def __init__(self, block_id: int):
            self.block_id, self.ref_cnt = block_id, 0

    primary: OrderedDict[bytes, Status] = OrderedDict()
    tiers: list[dict[bytes, bool]] = [{}, {}]
    stored, missing = _keys(0, num_blocks), _keys(num_blocks, num_blocks)
    start = time.perf_counter()
    for i, key in enumerate(stored):
        primary[key] = Status(i)
        for tier in tiers:
            tier[key] = True
    results = {STORE_ROW: (time.perf_counter() - start) / num_blocks}

    def hit(key: bytes, _ctx: ReqContext) -> bool:
        block = primary.get(key)
        return block is not None and block.ref_cnt >= 0

    def miss(key: bytes, _ctx: ReqContext) -> bool:
        return key in primary or any(key in tier for tier in tiers)

    results["lookup, primary hit"] = _per_call(hit, stored)
    results["lookup, miss in every tier"] = _per_call(miss, missing)
    results["on_schedule_end, nothing to do"] = _per_call(lambda _key, _ctx: None, stored)
    return results


def time_cpu_eviction(num_blocks: int, batch: int, retained: bool) -> tuple[float, float]:
    """Seconds per evicting store (a request of `batch` new blocks, finished) in a full CPU
    tier of `num_blocks` rows whose coldest fifth a client retained (`retained`) or not: the
    mean, and the worst single store."""
    region = SharedOffloadRegion(f"bench-evict-{os.getpid()}", num_blocks, cpu_page_size=64)
    primary = CPUPrimaryTierOffloadingManager(num_blocks, region, retention_max_fraction=RETAINED_FRACTION)
    held = int(RETAINED_FRACTION * num_blocks)
    hint = {"kv_tiering": {"retain": "7d"}} if retained else None

    def store(keys: list[OffloadKey], request: ReqContext) -> None:
        primary.complete_store(primary.prepare_store(keys, request).keys_to_store, request)  # type: ignore[union-attr]
        primary.on_request_finished(request)

    try:
        for start in range(0, num_blocks, batch):
            request = ReqContext(f"r{start}", kv_transfer_params=hint if start < held else None)
            store(_keys(start, min(batch, num_blocks - start)), request)
        count = (num_blocks - held) // batch
        stores = [(_keys(num_blocks + i * batch, batch), ReqContext(f"new{i}")) for i in range(count)]
        worst, clock = 0.0, time.perf_counter
        began = clock()
        for keys, request in stores:
            since = clock()
            store(keys, request)
            worst = max(worst, clock() - since)
        return (clock() - began) / len(stores), worst
    finally:
        primary.shutdown()


def time_index_eviction(num_blocks: int, retained: bool) -> tuple[float, float]:
    """Seconds per evicted block in a full secondary tier's index of `num_blocks` blocks
    whose coldest fifth a client retained (`retained`) or not: the mean, and the worst single
    reservation."""
    held = int(RETAINED_FRACTION * num_blocks)
    index = BlockIndex("bench", num_blocks, max_retained=held)
    evicted: list[OffloadKey] = []
    for key in _keys(0, num_blocks):
        index.reserve_all([(key, 0)], lambda _key: 1, evicted)
        index.mark_stored(key)
    if retained:
        index.retain(_keys(0, held), 7 * 86400.0)
    new = _keys(num_blocks, num_blocks - held)
    worst, clock = 0.0, time.perf_counter
    began = clock()
    for key in new:
        since = clock()
        index.reserve_all([(key, 0)], lambda _key: 1, evicted)
        worst = max(worst, clock() - since)
        index.mark_stored(key)
    assert len(evicted) == len(new)
    return (clock() - began) / len(new), worst


def measure_eviction(batch: int, repeats: int, scale: float = 1.0) -> list[dict[tuple[str, int], tuple[float, ...]]]:
    """Each of `repeats` interleaved runs' seconds of each `EVICTION_SIZES` row (its size
    times `scale`): the mean per store (or evicted block) without hints and retained, then the
    worst single one of each."""
    rounds: list[dict[tuple[str, int], tuple[float, ...]]] = []
    sizes = [(where, max(10 * batch, round(size * scale))) for where, size in EVICTION_SIZES]
    for _ in range(repeats):
        rounds.append({})
        for where, size in sizes:
            with _gc_paused():
                if where == "CPU tier":
                    plain, held = time_cpu_eviction(size, batch, False), time_cpu_eviction(size, batch, True)
                else:
                    plain, held = time_index_eviction(size, False), time_index_eviction(size, True)
            rounds[-1][(where, size)] = (plain[0], held[0], plain[1], held[1])
    return rounds


def best_of(rounds: list[dict]) -> dict:
    """Each key's least value of each field over `rounds` (dicts of tuples of seconds)."""
    return {key: tuple(min(each) for each in zip(*(run[key] for run in rounds), strict=True)) for key in rounds[0]}


def time_index_store(num_blocks: int, batch: int, events: bool) -> float:
    """Seconds per block of a block-store tier's scheduler-thread work for finished store jobs
    of `batch` blocks into its full index of `num_blocks` (each reserving room, so evicting,
    then applied), with KV events (`events`) taken after each job or none kept."""
    index, counters = BlockIndex("bench", num_blocks), TierCounters("bench")
    evicted: list[OffloadKey] = []
    for key in _keys(0, num_blocks):
        index.reserve_all([(key, 0)], lambda _key: 1, evicted)
        index.mark_stored(key)
    if events:
        index.start_events(TierEvents(STORAGE, LOCAL, "bench"))
        assert index.events is not None
        index.events.take()  # the blocks held, announced when events start
    jobs = [_keys(num_blocks + start, batch) for start in range(0, num_blocks - batch + 1, batch)]
    began = time.perf_counter()
    for job, keys in enumerate(jobs):
        index.reserve_all([(key, 0) for key in keys], lambda _key: 1, evicted)
        apply_store(index, counters, StoreDone(job_id=job, keys=keys, ok=set(keys)), evicts_itself=False)
        if index.events is not None:
            index.events.take()
    return (time.perf_counter() - began) / (len(jobs) * batch)


def measure_events(num_blocks: int, batch: int, repeats: int, policy: str = "lru") -> list[dict[str, tuple]]:
    """(events off, on) seconds per block stored of a request through the manager and of a
    block-store tier's applied job, in each of `repeats` interleaved runs."""
    rounds: list[dict[str, tuple]] = []
    for _ in range(repeats):
        with _gc_paused():
            manager = tuple(time_engine(num_blocks, batch, policy, events=on)[STORE_ROW] for on in (False, True))
            job = tuple(time_index_store(num_blocks, batch, on) for on in (False, True))
        rounds.append({"request's store via manager": manager, "block-store tier's store job": job})
    return rounds


@contextlib.contextmanager
def _gc_paused():
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _per_call(call: Callable[[OffloadKey, ReqContext], object], keys: list[OffloadKey]) -> float:
    start = time.perf_counter()
    for key in keys:
        call(key, CTX)
    return (time.perf_counter() - start) / len(keys)


def measure(
    num_blocks: int, batch: int, repeats: int, policy: str = "lru", hints: str = "none"
) -> list[dict[str, tuple[float, float]]]:
    """(engine, baseline) seconds of each operation in each of `repeats` interleaved runs."""
    rounds: list[dict[str, tuple[float, float]]] = []
    for _ in range(repeats):
        with _gc_paused():
            engine, baseline = time_engine(num_blocks, batch, policy, hints), time_baseline(num_blocks, batch)
            surviving = time_engine(num_blocks, batch, policy, hints, survive=True)[STORE_ROW]
        rounds.append({op: (seconds, baseline[op]) for op, seconds in engine.items()})
        rounds[-1][SURVIVING_ROW] = (surviving, baseline[STORE_ROW])
    return rounds


def time_handoff(num_jobs: int, job_blocks: int = 16) -> dict[str, float]:
    """Scheduler-thread seconds per job for three ways of handing a job to a loop thread."""
    rows = np.zeros((num_jobs * job_blocks, 64), dtype=np.uint8)
    config = {"type": "memory", "latency_s": 60.0, "max_concurrency": num_jobs}
    tier = SecondaryTierFactory.create_secondary_tier(config, rows.data, None)
    keys = _keys(0, num_jobs * job_blocks)
    spans = [range(j * job_blocks, (j + 1) * job_blocks) for j in range(num_jobs)]
    jobs = [JobMetadata(j, keys[s.start : s.stop], np.array(s), False, CTX) for j, s in enumerate(spans)]
    results = {}
    try:
        start = time.perf_counter()
        for job in jobs:
            tier.submit_store(job)
        tier.on_schedule_end()
        results[f"BlockStoreTier.submit_store, {job_blocks} blocks, + one flush"] = (
            time.perf_counter() - start
        ) / num_jobs
    finally:
        tier.shutdown()
        tier.get_finished()
    runtime = AsyncRuntime("tiering-bench")
    try:
        runtime.run_sync(_running_loop)  # started
        start = time.perf_counter()
        for _ in range(num_jobs):
            runtime.submit(lambda: None)
        runtime.flush()
        results["AsyncRuntime.submit per job + one flush"] = (time.perf_counter() - start) / num_jobs

        async def nothing() -> None:
            return None

        loop = runtime.run_sync(_running_loop)
        start = time.perf_counter()
        futures = [asyncio.run_coroutine_threadsafe(nothing(), loop) for _ in range(num_jobs)]
        results["asyncio.run_coroutine_threadsafe per job"] = (time.perf_counter() - start) / num_jobs
        for future in futures:
            future.result(10)
    finally:
        runtime.shutdown()
    return results


async def _running_loop() -> asyncio.AbstractEventLoop:
    return asyncio.get_running_loop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=20_000, help="blocks stored and looked up (default 20000)")
    parser.add_argument("--batch", type=int, default=16, help="blocks per prepare_store call (default 16)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved runs; the best is kept (default 5)")
    parser.add_argument(
        "--policy", choices=cache_policy_names(), default="lru", help="the CPU tier's eviction policy (default lru)"
    )
    parser.add_argument(
        "--hints",
        type=checked(transfer_params),
        default="none",
        help=f"the retention hint every request sends: {HINTS} (none)",
    )
    parser.add_argument(
        "--eviction-repeats",
        type=int,
        default=2,
        help="interleaved runs of the eviction table, the best kept; 0 skips it (default 2)",
    )
    scale = "the eviction table's tier sizes times this (default 1: 200,000 and 1,000,000 rows)"
    parser.add_argument("--eviction-scale", type=float, default=1.0, help=scale)
    add_json_argument(parser)
    args = parser.parse_args(argv)
    report = open_report(parser, args, "scheduler_cost", argv)
    rounds = measure(args.blocks, args.batch, args.repeats, args.policy, args.hints)
    table = Table(
        title=f"Scheduler-thread cost, {args.blocks} blocks, {args.policy}, hints {args.hints}, two example tiers, "
        f"best of {args.repeats}"
    )
    table.add_column("operation")
    table.add_column("engine (us)", justify="right")
    table.add_column("raw baseline (us)", justify="right")
    table.add_column("ratio", justify="right")
    for op, (engine, baseline) in best_of(rounds).items():
        table.add_row(op, f"{engine * 1e6:.2f}", f"{baseline * 1e6:.2f}", f"{engine / baseline:.1f}x")
    report.print(table, rounds)
    if args.eviction_repeats > 0:
        eviction = Table(
            title=f"Eviction with a fifth of the tier retained (7d hints), best of {args.eviction_repeats}"
        )
        for column in ("tier", "size", "per", "no hints (us)", "retained (us)", "ratio", *EVICTION_WORST):
            eviction.add_column(column, justify="left" if column in ("tier", "per") else "right")
        evictions = measure_eviction(args.batch, args.eviction_repeats, args.eviction_scale)
        for (where, size), (plain, held, *worst) in best_of(evictions).items():
            per = f"store of {args.batch}" if where == "CPU tier" else "evicted block"
            means = (f"{plain * 1e6:.2f}", f"{held * 1e6:.2f}", f"{held / plain:.2f}x")
            worsts = (f"{worst[0] * 1e6:.1f}", f"{worst[1] * 1e6:.1f}", f"{worst[1] / worst[0]:.2f}x")
            eviction.add_row(where, f"{size:,}", per, *means, *worsts)
        report.print(eviction, evictions)
    events = Table(
        title=f"KV events, per block stored, best of {args.repeats}: a request's store through the manager "
        f"(CPU tier + 2 example tiers); a block-store tier's store job of {args.batch} blocks into its full "
        f"index of {args.blocks} (one block evicted per block)"
    )
    for column in ("where", "events off (us)", "events on (us)", "cost (us)"):
        events.add_column(column, justify="left" if column == "where" else "right")
    event_rounds = measure_events(args.blocks, args.batch, args.repeats, args.policy)
    for row, (off, on) in best_of(event_rounds).items():
        events.add_row(row, f"{off * 1e6:.2f}", f"{on * 1e6:.2f}", f"{(on - off) * 1e6:+.2f}")
    report.print(events, event_rounds)
    handoff = Table(title="Scheduler-thread cost of handing one job to the loop thread")
    handoff.add_column("handoff")
    handoff.add_column("us per job", justify="right")
    with _gc_paused():
        handoffs = time_handoff(max(100, args.blocks // 16))
    for name, seconds in handoffs.items():
        handoff.add_row(name, f"{seconds * 1e6:.2f}")
    report.print(handoff, handoffs)
    report.write()


if __name__ == "__main__":
    main()
