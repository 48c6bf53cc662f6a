"""The scheduler-thread cost of each manager call, for one side (``ours`` or ``vllm``) and
one eviction policy, in one process: ``python -m tiering.benchmarks.versus_vllm.sched SIDE
POLICY REPEATS`` prints a JSON object of microseconds (per block for stores, per call
otherwise), each the median over REPEATS fresh managers.

Both sides get the same calls under the same names, as a scheduler makes them: a CPU tier of
`ROWS` rows cascading to two in-memory example tiers; a request opened and finished around
every `BATCH` blocks; a step (``on_schedule_end`` and ``take_events``) after each stored
batch. Measured, in this order:

- ``store``: ``prepare_store`` + ``complete_store`` of `ROWS` new blocks, per block;
- ``hit``: ``lookup`` of each of them, per call;
- ``miss``: ``lookup`` of blocks no tier holds, per call;
- ``idle step``: a step with nothing to do;
- ``evicting store``: ``prepare_store`` + ``complete_store`` into the full tier, per block.

vLLM's side is vLLM's own classes (`tiering.benchmarks.versus_vllm.tree` makes them
importable). vLLM's callers hold ``manager.lock``; its connector takes it once per step, so
its numbers here leave out one uncontended lock acquisition a step.

Thread: the main thread of the child process.
"""

from __future__ import annotations

import functools
import json
import mmap
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

ROWS, BATCH = 10_000, 16
CALLS = ("store", "hit", "miss", "idle step", "evicting store")


class Region:
    """The CPU tier's rows in page-aligned process memory, as a shared region's are, for both
    sides (``create_kv_memoryview``), holding bytes as a GPU store leaves them. (Rows never
    written read as the kernel's zero page: a tier that checks what it writes maps that one
    page into every row it reads, and its O_DIRECT writes from them then run far below the
    disk's rate; a tier that never reads the rows does not pay that. Real rows never do.)"""

    def __init__(self, rows: int, row_bytes: int = 64):
        self._rows = np.frombuffer(mmap.mmap(-1, rows * row_bytes), dtype=np.uint8).reshape(rows, row_bytes)
        self._rows[:] = (np.arange(row_bytes) % 251 + 1).astype(np.uint8)

    def create_kv_memoryview(self) -> memoryview:
        return self._rows.data

    def cleanup(self) -> None:
        pass


def ours(policy: str) -> tuple[Any, Callable[[], None], Callable[[bytes], bytes], type]:
    """Our manager, its step, its key maker and its request context class."""
    from tiering import CPUPrimaryTierOffloadingManager, ReqContext, TieringOffloadingManager, make_offload_key
    from tiering.backends.example import ExampleSecondaryTierManager

    primary = CPUPrimaryTierOffloadingManager(ROWS, Region(ROWS), cache_policy=policy)
    view = primary.get_kv_memoryview()
    tiers = [ExampleSecondaryTierManager(None, view, "example") for _ in range(2)]
    manager = TieringOffloadingManager(primary, tiers)
    return manager, manager.on_schedule_end, functools.partial(make_offload_key, group_idx=0), ReqContext


def vllm(policy: str) -> tuple[Any, Callable[[], None], Callable[[bytes], bytes], type]:
    """vLLM 0.33's manager, its step (with an empty schedule), key maker and request context."""
    from vllm.v1.kv_offload.base import ReqContext, ScheduleEndContext, make_offload_key
    from vllm.v1.kv_offload.tiering.example.manager import ExampleSecondaryTierManager
    from vllm.v1.kv_offload.tiering.manager import CPUPrimaryTierOffloadingManager, TieringOffloadingManager

    primary = CPUPrimaryTierOffloadingManager(num_chunks=ROWS, mmap_region=Region(ROWS), cache_policy=policy)
    view = primary.get_kv_memoryview()
    tiers = [ExampleSecondaryTierManager(None, view, "example") for _ in range(2)]
    manager = TieringOffloadingManager(primary, tiers)
    step = functools.partial(manager.on_schedule_end, ScheduleEndContext((), ()))
    return manager, step, functools.partial(make_offload_key, group_idx=0), ReqContext


def measure(side: str, policy: str) -> dict[str, float]:
    """Microseconds of each of `CALLS` on `side` under `policy`."""
    manager, on_schedule_end, make_key, context = (ours if side == "ours" else vllm)(policy)
    keys = [make_key(i.to_bytes(32, "big")) for i in range(2 * ROWS)]
    take_events = manager.take_events
    requests = iter(range(10**9))

    def batches(start: int, stop: int, body: Callable[[list, Any], None]) -> float:
        began = time.perf_counter_ns()
        for i in range(start, stop, BATCH):
            request = context(f"r{next(requests)}")
            manager.on_new_request(request)
            body(keys[i : i + BATCH], request)
            manager.on_request_finished(request)
        return (time.perf_counter_ns() - began) / (stop - start) / 1000

    def store(chunk: list, request: Any) -> None:
        if manager.prepare_store(chunk, request) is not None:
            manager.complete_store(chunk, request)
        on_schedule_end()
        list(take_events())

    def look(chunk: list, request: Any) -> None:
        for key in chunk:
            manager.lookup(key, request)

    try:
        results = {"store": batches(0, ROWS, store)}
        for _ in range(2):
            on_schedule_end()
        results["hit"] = batches(0, ROWS, look)
        results["miss"] = batches(ROWS + ROWS // 2, 2 * ROWS, look)
        began = time.perf_counter_ns()
        for _ in range(ROWS):
            on_schedule_end()
            list(take_events())
        results["idle step"] = (time.perf_counter_ns() - began) / ROWS / 1000
        results["evicting store"] = batches(ROWS, ROWS + ROWS // 2, store)
        return results
    finally:
        manager.shutdown()


def main(argv: list[str]) -> None:
    """``SIDE POLICY REPEATS``: the median of each call over REPEATS fresh managers, as JSON."""
    side, policy, repeats = argv[0], argv[1], int(argv[2])
    runs = [measure(side, policy) for _ in range(repeats)]
    print(json.dumps({call: statistics.median(run[call] for run in runs) for call in CALLS}))


if __name__ == "__main__":
    main(sys.argv[1:])
