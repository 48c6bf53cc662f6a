"""How long a file tier takes to be ready after a restart, beside a raw scan of the same tree.

For each layout (``files``: one file per block, ``segments``: many per file) and object
count, it fills a file tier with that many small blocks through the tier itself, shuts it
down, and then, interleaved `--repeats` times (best kept), measures:

- open: building the tier, until it serves (lookups answer from then on, misses for the
  blocks not indexed yet);
- first lookup: one lookup right after that, microseconds: it never waits for the recovery;
- ready: until every block the store held is indexed (`BlockStoreTier.wait_recovered`);
- raw scandir: `os.scandir` of every directory under the tier's root (names and types: the
  least a scan of the tree can read); ``files`` also with one `stat` per file (what ordering
  by last write needs at least, the tier reads a header page besides); ``segments`` also with
  one header page read per entry (`os.pread` of 4 KiB at each entry's offset: what mapping
  the entries needs at least);
- memory per block: what the ready tier holds in Python objects (its index, and the segments'
  map of entries), measured with `tracemalloc` in one more start, untimed.

The tree is warm in the page cache (it was just written); `--drop-caches` (root only) drops
the caches before every timed scan, the engine's and the raw ones, for a cold start.

    python -m tiering.benchmarks.file_recovery --dir /path/on/the/disk --objects 100000,1000000
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np
from rich.table import Table

from tiering import BlockStoreTier, JobMetadata, ReqContext, SecondaryTierFactory, make_offload_key
from tiering.backends.file.objects import ALIGN
from tiering.backends.file.segment_io import SUFFIX, padded
from tiering.benchmarks.json_report import add_json_argument, open_report

CTX = ReqContext("bench")
ROW_BYTES = 4096  # a small block: a million objects is 8 GiB on disk in either layout
FILL_ROWS = 4096  # primary rows the filling tier copies from (keys differ, bytes repeat)
LAYOUTS = ("files", "segments")


def _config(root: Path, layout: str) -> dict:
    return {"type": "file", "root_dir": str(root), "layout": layout, "direct_io": False}


def _tier(root: Path, layout: str, rows: np.ndarray) -> BlockStoreTier:
    tier = SecondaryTierFactory.create_secondary_tier(_config(root, layout), rows.data, None)
    assert isinstance(tier, BlockStoreTier)
    return tier


def fill(root: Path, layout: str, count: int, rows: np.ndarray) -> None:
    """Store `count` blocks in a file tier under `root`, a job of `FILL_ROWS` at a time."""
    tier = _tier(root, layout, rows)
    try:
        tier.wait_recovered()
        for job_id, start in enumerate(range(0, count, FILL_ROWS)):
            ids = range(start, min(start + FILL_ROWS, count))
            keys = [make_offload_key(i.to_bytes(8, "big"), 0) for i in ids]
            tier.submit_store(JobMetadata(job_id, keys, np.arange(len(keys), dtype=np.int64), False, CTX))
            tier.on_schedule_end()
            if not tier.drain(600) or not all(result.success for result in tier.get_finished()):
                raise RuntimeError(f"filling the {layout} tier failed")
    finally:
        tier.shutdown()


def drop_caches() -> None:
    """Write back and drop the page, dentry and inode caches (root only)."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def engine_start(root: Path, layout: str, rows: np.ndarray) -> dict[str, float]:
    """Seconds until the tier serves, the first lookup's, and until it is ready."""
    start = time.perf_counter()
    tier = _tier(root, layout, rows)
    opened = time.perf_counter()
    tier.lookup(make_offload_key(bytes(8), 0), CTX)
    looked_up = time.perf_counter()
    try:
        if not tier.wait_recovered(3600):
            raise RuntimeError(f"the {layout} tier did not recover in an hour")
        ready = time.perf_counter()
        blocks = len(tier.index)
    finally:
        tier.shutdown()
    return {"open": opened - start, "lookup": looked_up - opened, "ready": ready - start, "blocks": blocks}


def memory_per_block(root: Path, layout: str, rows: np.ndarray) -> float:
    """Bytes of Python objects a ready tier holds, per block (`tracemalloc`)."""
    tracemalloc.start()
    try:
        tier = _tier(root, layout, rows)
        try:
            tier.wait_recovered(3600)
            return tracemalloc.get_traced_memory()[0] / max(1, len(tier.index))
        finally:
            tier.shutdown()
    finally:
        tracemalloc.stop()


def raw_scan(root: Path, layout: str) -> dict[str, float]:
    """Seconds of `os.scandir` over the tree, and of it with the per-object work a recovery
    needs at least."""
    start = time.perf_counter()
    entries = _scandir(root, stat=False, headers=False)
    names = time.perf_counter() - start
    start = time.perf_counter()
    _scandir(root, stat=layout == "files", headers=layout == "segments")
    return {"raw scandir": names, "raw per object": time.perf_counter() - start, "entries": entries}


def _scandir(directory: Path, stat: bool, headers: bool) -> int:
    """Entries under `directory`; with `stat`, each file stat'ed; with `headers`, a header
    page read at each segment entry's offset (every entry takes a page and a block)."""
    count = 0
    page = bytearray(ALIGN)
    with os.scandir(directory) as entries:
        for entry in entries:
            count += 1
            if entry.is_dir(follow_symlinks=False):
                count += _scandir(Path(entry.path), stat, headers)
            elif stat:
                entry.stat(follow_symlinks=False)
            elif headers and entry.name.endswith(SUFFIX):
                with open(entry.path, "rb", buffering=0) as segment:
                    size = os.fstat(segment.fileno()).st_size
                    for offset in range(0, size, ALIGN + padded(ROW_BYTES)):
                        os.preadv(segment.fileno(), [page], offset)
    return count


def measure(base: Path, layout: str, count: int, repeats: int, cold: bool) -> dict[str, list[float]]:
    """Each of `repeats` interleaved rounds' measurements (seconds, counts), and the bytes of
    memory per block (one value)."""
    rows = np.zeros((FILL_ROWS, ROW_BYTES), dtype=np.uint8)
    rows[:] = np.arange(ROW_BYTES, dtype=np.uint8)
    root = base / f"{layout}-{count}"
    fill(root, layout, count, rows)
    rounds: dict[str, list[float]] = {}
    try:
        for repeat in range(repeats):
            sides = [lambda: engine_start(root, layout, rows), lambda: raw_scan(root, layout)]
            for side in sides if repeat % 2 == 0 else sides[::-1]:
                if cold:
                    drop_caches()
                for name, value in side().items():
                    rounds.setdefault(name, []).append(value)
        rounds["memory per block"] = [memory_per_block(root, layout, rows)]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return rounds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None, help="directory on the disk to measure (default: a temp dir)")
    parser.add_argument("--objects", default="100000", help="comma-separated object counts (default 100000)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated: files, segments")
    parser.add_argument("--repeats", type=int, default=2, help="interleaved runs; the best is kept (default 2)")
    parser.add_argument("--drop-caches", action="store_true", help="drop the page cache before each scan (root)")
    add_json_argument(parser)
    args = parser.parse_args(argv)
    if args.dir is not None and not args.dir.is_dir():
        parser.error(f"--dir: {args.dir} is not a directory (give one on the disk to measure)")
    try:
        counts = [int(count) for count in args.objects.split(",")]
    except ValueError:
        parser.error(f"--objects: expected comma-separated integers; got {args.objects!r}")
    layouts = args.layouts.split(",")
    if unknown := set(layouts) - set(LAYOUTS):
        parser.error(f"--layouts: expected files or segments; got {', '.join(sorted(unknown))}")
    if args.drop_caches and os.geteuid() != 0:
        parser.error("--drop-caches needs root")
    cache, report, values = "cold" if args.drop_caches else "warm", open_report(parser, args, "file_recovery", argv), {}
    table = Table(title=f"File tier start after a restart, {cache} page cache, best of {args.repeats}")
    columns = ["layout", "objects", "open s", "1st lookup us", "ready s", "raw scandir s", "raw + per object s"]
    for column in [*columns, "ready / raw", "memory B/block"]:
        table.add_column(column, justify="left" if column == "layout" else "right")
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="tiering-bench-") as base:
        for layout in layouts:
            for count in counts:
                rounds = measure(Path(base), layout, count, args.repeats, args.drop_caches)
                best = {name: min(each) for name, each in rounds.items()}
                values[f"{layout} {count}"] = rounds
                raw = best["raw per object"]
                table.add_row(
                    layout,
                    f"{int(best['blocks']):,}",
                    f"{best['open']:.2f}",
                    f"{best['lookup'] * 1e6:.0f}",
                    f"{best['ready']:.2f}",
                    f"{best['raw scandir']:.2f}",
                    f"{best['raw per object']:.2f}",
                    f"{best['ready'] / raw:.2f}x",
                    f"{best['memory per block']:.0f}",
                )
    report.print(table, values, width=140)
    report.write()


if __name__ == "__main__":
    main()
