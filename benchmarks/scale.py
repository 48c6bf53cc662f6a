"""Memory per block and the cost of a call at scale: the CPU tier's bookkeeping at up to a
million rows, and a block-store tier's index at up to ten million objects.

For each size it builds the structure, fills it through its own calls, and prints:

- bytes per block: what the filled structure holds in Python objects (`tracemalloc`),
  divided by its blocks, the key's bytes object included (36 bytes: a 32-byte block hash and
  the KV-group index, as vLLM's keys are);
- the cost of a call, microseconds per block, best of `--repeats`, at each size: for the CPU
  tier, a store into the full tier (`prepare_store` + `complete_store` of 16 blocks, each
  evicting one, and the request's end) and a lookup that hits; for the index, a store of one
  object into the full index (`reserve_all`, evicting one, and `mark_stored`) and a hit
  (`get` and `touch`). Beside them, a raw `OrderedDict` of as many keys: a store is an item
  set and the oldest item popped, a hit a `get` and a `move_to_end`. A cost that grows with
  the size no faster than the raw one's (memory latency: a larger table misses the caches
  more) is what a scheduler needs: no call walks the structure.

The index is the same for both file layouts (one file per block, segments). The segments
layout also maps each object to where it lies in its segment file; that map is built here as
the segment log builds it (one `Entry` per object, a segment per 64 MiB of objects) and its
bytes per block are printed apart. The one-file layout keeps nothing per object in memory.

    python -m tiering.benchmarks.scale --rows 10000,1000000 --objects 10000,10000000
"""

from __future__ import annotations

import argparse
import gc
import time
import tracemalloc
from collections import OrderedDict
from collections.abc import Callable

from rich.table import Table

from tiering import CPUOffloadingManager, OffloadKey, ReqContext, make_offload_key
from tiering.backends.file.segment_io import Entry, Segment
from tiering.backends.file.segments import SEGMENT_BYTES
from tiering.benchmarks.json_report import add_json_argument, open_report
from tiering.tiers.blockstore.index import BlockIndex

BATCH = 16  # blocks per store, as a scheduler step stores a request's new blocks
OBJECT_BYTES = 2 << 20  # an index entry's object: a 2 MiB block (the size only sets capacity)
TIMED_BLOCKS = 16_000  # blocks per timed run of a call (fewer in a smaller structure)


def key_of(i: int) -> OffloadKey:
    """The key of block `i`: a 32-byte hash and KV-group index 0."""
    return make_offload_key(i.to_bytes(32, "big"), 0)


def grown(build: Callable[[], object]) -> tuple[object, int]:
    """What `build` returns, and the bytes of Python objects it holds (allocated by `build`
    and still alive once it returned)."""
    gc.collect()
    tracemalloc.start()
    try:
        built = build()
        gc.collect()
        return built, tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()


def best_us(run: Callable[[int], None], blocks: int, repeats: int) -> float:
    """Microseconds per block of `run(start)` (it handles `blocks` blocks from key `start`),
    best of `repeats` runs, each on keys not seen before."""
    best = float("inf")
    for repeat in range(repeats):
        start = time.perf_counter()
        run(repeat)
        best = min(best, (time.perf_counter() - start) / blocks * 1e6)
    return best


def cpu_tier(rows: int, policy: str, repeats: int) -> dict[str, float]:
    """The CPU tier (`CPUOffloadingManager`) of `rows` rows, filled: bytes per block, and a
    store into the full tier and a lookup hit, us per block."""

    def fill() -> CPUOffloadingManager:
        manager = CPUOffloadingManager(rows, policy)
        for start in range(0, rows, BATCH):
            keys = [key_of(i) for i in range(start, min(rows, start + BATCH))]
            context = ReqContext(f"fill-{start}")
            manager.prepare_store(keys, context)
            manager.complete_store(keys, context)
            manager.on_request_finished(context)
        return manager

    built, memory = grown(fill)
    assert isinstance(built, CPUOffloadingManager)
    manager, timed = built, min(TIMED_BLOCKS, rows)
    fresh = [[key_of(rows + repeat * timed + i) for i in range(timed)] for repeat in range(repeats)]
    held = [key_of(i) for i in range(timed)]  # resident until the stores below

    def store(repeat: int) -> None:
        keys = fresh[repeat]
        for start in range(0, timed, BATCH):
            batch, context = keys[start : start + BATCH], ReqContext(f"store-{start}")
            manager.prepare_store(batch, context)
            manager.complete_store(batch, context)
            manager.on_request_finished(context)

    def lookup(repeat: int) -> None:
        for start in range(0, timed, BATCH):
            context = ReqContext(f"lookup-{repeat}-{start}")
            for key in held[start : start + BATCH]:
                manager.lookup(key, context)
            manager.on_request_finished(context)

    lookup_us = best_us(lookup, timed, repeats)  # (lookups change no order: measured first)
    return {"bytes": memory / rows, "store_us": best_us(store, timed, repeats), "lookup_us": lookup_us}


def block_index(objects: int, repeats: int) -> dict[str, float]:
    """A block-store tier's `BlockIndex` of `objects` 2 MiB objects, full: bytes per object,
    and a store into it and a hit, us per block; and the segment layout's map of the same
    objects, bytes per object."""

    def fill() -> BlockIndex:
        index = BlockIndex("scale", capacity_bytes=objects * OBJECT_BYTES)
        index.add_recovered((key_of(i), OBJECT_BYTES) for i in range(objects - 1, -1, -1))
        return index

    built, memory = grown(fill)
    assert isinstance(built, BlockIndex)
    index, timed = built, min(TIMED_BLOCKS, objects)
    fresh = [[key_of(objects + repeat * timed + i) for i in range(timed)] for repeat in range(repeats)]

    def store(repeat: int) -> None:
        evicted: list[OffloadKey] = []
        for key in fresh[repeat]:
            index.reserve_all(((key, 0),), lambda _: OBJECT_BYTES, evicted)
            index.mark_stored(key)
            index.deleted(evicted)  # (the tier's delete of the evicted object is over)
            evicted.clear()

    def hit(repeat: int) -> None:
        for key in fresh[-1]:  # the last stored: all held
            if index.get(key) is not None:
                index.touch((key,))

    per_segment = max(1, SEGMENT_BYTES // OBJECT_BYTES)

    def segment_map() -> dict[OffloadKey, Entry]:
        segments = [Segment(sequence, -1, -1) for sequence in range(objects // per_segment + 1)]
        return {
            key_of(i): Entry(segments[i // per_segment], (i % per_segment) * OBJECT_BYTES, OBJECT_BYTES)
            for i in range(objects)
        }

    store_us = best_us(store, timed, repeats)
    hit_us = best_us(hit, timed, repeats)
    _, segments_memory = grown(segment_map)
    return {
        "bytes": memory / objects,
        "segments_bytes": segments_memory / objects,
        "store_us": store_us,
        "lookup_us": hit_us,
    }


def raw_dict(blocks: int, repeats: int) -> dict[str, float]:
    """The raw baseline: an `OrderedDict` of `blocks` keys; a store and a hit, us per block."""
    ordered: OrderedDict[OffloadKey, int] = OrderedDict((key_of(i), i) for i in range(blocks))
    timed = min(TIMED_BLOCKS, blocks)
    fresh = [[key_of(blocks + repeat * timed + i) for i in range(timed)] for repeat in range(repeats)]

    def store(repeat: int) -> None:
        for key in fresh[repeat]:
            ordered[key] = 0
            ordered.popitem(last=False)

    def hit(repeat: int) -> None:
        for key in fresh[-1]:
            if ordered.get(key) is not None:
                ordered.move_to_end(key)

    return {"store_us": best_us(store, timed, repeats), "lookup_us": best_us(hit, timed, repeats)}


def sizes(text: str) -> list[int]:
    """Comma-separated counts, each at least `BATCH`.

    Raises:
        argparse.ArgumentTypeError: not such a list.
    """
    try:
        counts = [int(part.replace("_", "")) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated counts, got {text!r}") from None
    if not counts or min(counts) < BATCH:
        raise argparse.ArgumentTypeError(f"each count must be at least {BATCH}, got {text!r}")
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=sizes, default=[16_000, 1_000_000], help="CPU tier sizes, rows")
    parser.add_argument("--objects", type=sizes, default=[16_000, 10_000_000], help="index sizes, objects")
    parser.add_argument("--policies", default="lru,arc", help="the CPU tier's eviction policies")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per call; the best is kept")
    add_json_argument(parser)
    args = parser.parse_args(argv)
    report, values = open_report(parser, args, "scale", argv), {}
    table = Table(title=f"Memory per block and cost per call at scale, best of {args.repeats}")
    for column in ("structure", "blocks", "bytes/block", "store us/block", "hit us/block"):
        table.add_column(column, justify="left" if column == "structure" else "right")
    for policy in args.policies.split(","):
        for rows in args.rows:
            values[f"CPU tier {policy} {rows}"] = row = cpu_tier(rows, policy, args.repeats)
            table.add_row(
                f"CPU tier, {policy}",
                f"{rows:,}",
                f"{row['bytes']:.0f}",
                f"{row['store_us']:.2f}",
                f"{row['lookup_us']:.2f}",
            )
    for objects in args.objects:
        values[f"tier index {objects}"] = row = block_index(objects, args.repeats)
        table.add_row(
            "tier index", f"{objects:,}", f"{row['bytes']:.0f}", f"{row['store_us']:.2f}", f"{row['lookup_us']:.2f}"
        )
        table.add_row("+ segments' map", f"{objects:,}", f"{row['segments_bytes']:.0f}", "-", "-")
    for blocks in sorted({*args.rows, *args.objects}):
        values[f"raw OrderedDict {blocks}"] = row = raw_dict(blocks, args.repeats)
        table.add_row("raw OrderedDict", f"{blocks:,}", "-", f"{row['store_us']:.2f}", f"{row['lookup_us']:.2f}")
    report.print(table, values)
    report.write()


if __name__ == "__main__":
    main()
