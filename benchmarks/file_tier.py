"""File tier GB/s against a raw thread pool on the same directory, side by side.

For each block size and mode it moves the same blocks two ways in one run, interleaved
`--repeats` times (best kept). Modes: ``buffered`` (page cache), ``fsync`` (page cache, each
file fsynced), ``direct`` (O_DIRECT, the tier's default).

- engine: a `file` tier fed store jobs of `--job-blocks` blocks from the scheduler thread,
  then load jobs back into the rows, timed from the first submission to the last result;
- raw: a `ThreadPoolExecutor` of the same concurrency with the same durability, per block:
  XXH3-64 of the payload into a 4 KiB header, open a temporary name + `os.pwritev` of header
  and payload (+ `fsync`) + close + rename; and open + `os.preadv` into header and row +
  close + checksum check; the same bytes in the same place, with the same open flags;
- rounds: the lowest and highest ratio of the engine's run to raw's run of the same round
  (side by side), beside the ratio of the best runs: how much the machine moved them;
- check: the share of raw's time that goes to the XXH3-64 (raw run again without it): a
  checked read or write cannot come closer than that to an unchecked one on this machine
  ("noise" where the checked run was the faster);
- aiofiles: the same per-block steps as raw, written with aiofiles (open, write, fsync and
  rename, then open and readinto, each awaited on an event loop whose executor has the same
  number of threads): the library the mission first named for this tier, measured instead of
  assumed. It costs an executor hop per call where the tier makes one per batch.

With ``--seals signed,encrypted`` the engine also runs with integrity keys (`tiering.tiers.seal`),
interleaved with the rest, and the table shows what signing or encrypting costs against the
unsealed engine.

What the engine does beyond raw: its header also holds the key and the layout fingerprint
(parsed and checked on every load), the files are sharded into 256 directories opened
relative to a directory fd, and jobs cross from the scheduler thread to the loop and back.
Both read back what they just wrote (page cache warm for both in the buffered modes). Rows
are page-aligned, as in the shared region. It also reports the scheduler-thread cost of
handing one job to the tier.

    python -m tiering.benchmarks.file_tier --dir /path/on/the/disk [--seals signed,encrypted]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import mmap
import os
import secrets
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiofiles
import aiofiles.os
import numpy as np
from rich.table import Table

from tiering import JobMetadata, OffloadKey, ReqContext, SecondaryTierFactory, make_offload_key
from tiering.benchmarks.args import format_size, names_arg, sizes_arg
from tiering.benchmarks.json_report import add_json_argument, open_report
from tiering.tiers.object_format import payload_checksum

CTX = ReqContext("bench")


def _keys(count: int) -> list[OffloadKey]:
    return [make_offload_key(i.to_bytes(16, "big"), 0) for i in range(count)]


HEADER_BYTES = 4096  # the file tier's header, padded to a page for O_DIRECT
KEYS_ENV = "TIERING_BENCH_KEYS"  # a fresh secret key per run, for the sealed engine sides
SEALS = {"signed": {}, "encrypted": {"encryption": "aes-256-gcm"}}
MODES = {"buffered": (False, False), "fsync": (True, False), "direct": (False, True)}  # (fsync, O_DIRECT)


def run_engine(
    rows: np.ndarray, directory: Path, concurrency: int, mode: str, job_blocks: int, seal: str | None = None
) -> dict[str, float]:
    """Seconds to store then load every row through a file tier (its objects sealed as
    `seal` says: a key of `SEALS`, or None), and per-job handoff seconds."""
    fsync, direct = MODES[mode]
    config = {"type": "file", "root_dir": str(directory), "max_concurrency": concurrency, "fsync": fsync}
    if seal is not None:
        os.environ.setdefault(KEYS_ENV, secrets.token_hex(32))
        config |= {"integrity": {"keys_env": KEYS_ENV}, **SEALS[seal]}
    tier = SecondaryTierFactory.create_secondary_tier({**config, "direct_io": direct}, rows.data, None)
    keys = _keys(len(rows))
    jobs = [
        (keys[i : i + job_blocks], np.arange(i, min(i + job_blocks, len(rows)), dtype=np.int64))
        for i in range(0, len(rows), job_blocks)
    ]
    try:
        results = {}
        for direction, promotion in (("store", False), ("load", True)):
            submit = tier.submit_load if promotion else tier.submit_store
            handoff = 0.0
            start = time.perf_counter()
            for job_id, (job_keys, block_ids) in enumerate(jobs):
                before = time.perf_counter()
                submit(JobMetadata(job_id, job_keys, block_ids, promotion, CTX))
                handoff += time.perf_counter() - before
            if not tier.drain(600):
                raise RuntimeError("file tier did not finish in 600 s")
            results[direction] = time.perf_counter() - start
            results[f"{direction} handoff per job"] = handoff / len(jobs)
            if not all(result.success for result in tier.get_finished()):
                raise RuntimeError(f"file tier: a {direction} job failed")
        return results
    finally:
        tier.shutdown()


def run_raw(rows: np.ndarray, directory: Path, concurrency: int, mode: str, check: bool = True) -> dict[str, float]:
    """Seconds for a plain thread pool to write then read every row, one file each, with the
    engine's durability: a 4 KiB header holding the payload's XXH3-64 (the tier's own
    `payload_checksum`), written to a temporary name and renamed into place; a read checks it.
    Without `check`, no checksum is taken
    (what checking costs: the table's "check" column)."""
    fsync, direct = MODES[mode]
    direct_flag = os.O_DIRECT if direct else 0
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / f"{i:08d}" for i in range(len(rows))]
    headers = [memoryview(mmap.mmap(-1, HEADER_BYTES)) for _ in range(concurrency)]  # aligned, one per thread
    slot: dict[int, int] = {}

    def header() -> memoryview:
        return headers[slot.setdefault(threading.get_ident(), len(slot))]

    def write(i: int) -> None:
        head = header()
        if check:
            head[:8] = payload_checksum(rows[i]).to_bytes(8, "little")
        temporary = paths[i].with_suffix(".tmp")
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | direct_flag, 0o600)
        try:
            os.pwritev(fd, [head, rows[i]], 0)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(temporary, paths[i])

    def read(i: int) -> None:
        head = header()
        fd = os.open(paths[i], os.O_RDONLY | direct_flag)
        try:
            os.preadv(fd, [head, rows[i]], 0)
        finally:
            os.close(fd)
        if check and payload_checksum(rows[i]) != int.from_bytes(head[:8], "little"):
            raise RuntimeError(f"raw baseline: block {i} read back wrong")

    results = {}
    with ThreadPoolExecutor(concurrency) as pool:
        for direction, op in (("store", write), ("load", read)):
            start = time.perf_counter()
            list(pool.map(op, range(len(rows))))
            results[direction] = time.perf_counter() - start
    return results


def run_aiofiles(rows: np.ndarray, directory: Path, concurrency: int, mode: str) -> dict[str, float]:
    """`run_raw`'s per-block steps and durability, each call awaited through aiofiles."""
    fsync, direct = MODES[mode]
    direct_flag = os.O_DIRECT if direct else 0
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / f"{i:08d}" for i in range(len(rows))]
    headers = [memoryview(mmap.mmap(-1, HEADER_BYTES)) for _ in range(len(rows))]
    to_disk = aiofiles.os.wrap(os.fsync)

    def opener(path: str, flags: int) -> int:
        return os.open(path, flags | direct_flag, 0o600)

    async def write(i: int) -> None:
        headers[i][:8] = payload_checksum(rows[i]).to_bytes(8, "little")
        temporary = paths[i].with_suffix(".tmp")
        async with aiofiles.open(temporary, "wb", buffering=0, opener=opener) as file:
            await file.write(headers[i])
            await file.write(rows[i])
            if fsync:
                await to_disk(file.fileno())
        await aiofiles.os.rename(temporary, paths[i])

    async def read(i: int) -> None:
        async with aiofiles.open(paths[i], "rb", buffering=0, opener=opener) as file:
            await file.readinto(headers[i])
            await file.readinto(rows[i])
        if payload_checksum(rows[i]) != int.from_bytes(headers[i][:8], "little"):
            raise RuntimeError(f"aiofiles baseline: block {i} read back wrong")

    async def run_all() -> dict[str, float]:
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(concurrency))
        limit = asyncio.Semaphore(concurrency)

        async def bounded(op, i: int) -> None:
            async with limit:
                await op(i)

        results = {}
        for direction, op in (("store", write), ("load", read)):
            start = time.perf_counter()
            await asyncio.gather(*(bounded(op, i) for i in range(len(rows))))
            results[direction] = time.perf_counter() - start
        return results

    return asyncio.run(run_all())


def aligned_rows(num_blocks: int, block_bytes: int) -> np.ndarray:
    """Random rows in page-aligned memory, like the shared region's."""
    rows = np.frombuffer(mmap.mmap(-1, num_blocks * block_bytes), dtype=np.uint8).reshape(num_blocks, block_bytes)
    rows[:] = np.random.default_rng(0).integers(0, 256, size=rows.shape, dtype=np.uint8)
    return rows


def measure(
    block_bytes: int,
    total_bytes: int,
    base: Path,
    concurrency: int,
    mode: str,
    job_blocks: int,
    repeats: int,
    seals: list[str] = [],  # noqa: B006 - read only
) -> tuple[int, dict[str, list[float]]]:
    """Bytes moved per measurement, and the seconds of each measurement in each of `repeats`
    interleaved runs (in run order).

    One untimed round of each comes first, and the order alternates: on VMs the first
    touch of page-cache memory is far slower than reusing pages just freed, which would
    otherwise penalise whichever side runs first.
    """
    num_blocks = max(total_bytes // block_bytes, job_blocks)
    rows = aligned_rows(num_blocks, block_bytes)

    def engine_sealed(directory: Path, seal: str) -> dict[str, float]:
        return run_engine(rows, directory, concurrency, mode, job_blocks, seal)

    sides: list[tuple[str, Callable[[Path], dict[str, float]]]] = [
        ("engine", lambda d: run_engine(rows, d, concurrency, mode, job_blocks)),
        ("raw", lambda d: run_raw(rows, d, concurrency, mode)),
        ("raw unchecked", lambda d: run_raw(rows, d, concurrency, mode, check=False)),
        ("aiofiles", lambda d: run_aiofiles(rows, d, concurrency, mode)),
    ]
    for seal in seals:
        sides.append((f"engine {seal}", functools.partial(engine_sealed, seal=seal)))
    runs: dict[str, list[float]] = {}
    for repeat in range(-1, repeats):
        for name, run in sides if repeat % 2 == 0 else sides[::-1]:
            directory = base / f"{name}-{repeat}"
            try:
                for op, seconds in run(directory).items():
                    if repeat >= 0:
                        runs.setdefault(f"{name} {op}", []).append(seconds)
            finally:
                shutil.rmtree(directory, ignore_errors=True)
    return num_blocks * block_bytes, runs


def row_cells(moved: int, runs: dict[str, list[float]], direction: str, seals: list[str]) -> list[str]:
    """One table row's cells after block, mode and op: GB/s are of each side's best run; the
    spread is of the ratio of the engine's and raw's runs of the same round; a checksum share
    below zero (a checked run faster than an unchecked one) is noise and printed so."""
    best = {name: min(seconds) for name, seconds in runs.items()}
    engine, raw, via_aiofiles = (moved / best[f"{side} {direction}"] for side in ("engine", "raw", "aiofiles"))
    paired = [r / e for e, r in zip(runs[f"engine {direction}"], runs[f"raw {direction}"], strict=True)]
    share = 1 - best[f"raw unchecked {direction}"] / best[f"raw {direction}"]
    cells = [f"{engine / 1e9:.2f}", f"{raw / 1e9:.2f}", f"{engine / raw:.2f}x"]
    cells += [f"{min(paired):.2f}-{max(paired):.2f}x", f"{share:.0%}" if share >= 0 else "noise"]
    cells += [f"{via_aiofiles / 1e9:.2f}", f"{engine / via_aiofiles:.2f}x"]
    cells.append(f"{best[f'engine {direction} handoff per job'] * 1e6:.1f}")
    for seal in seals:
        sealed = moved / best[f"engine {seal} {direction}"]
        cells += [f"{sealed / 1e9:.2f}", f"{sealed / engine:.2f}x"]
    return cells


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None, help="directory on the disk to measure (default: a temp dir)")
    parser.add_argument(
        "--block-sizes", type=sizes_arg, default="64KiB,2MiB,32MiB", help="comma-separated sizes (%(default)s)"
    )
    parser.add_argument("--total-mib", type=int, default=512, help="data moved per measurement (default 512)")
    parser.add_argument("--concurrency", type=int, default=16, help="threads and operations in flight (default 16)")
    parser.add_argument("--job-blocks", type=int, default=16, help="blocks per job (default 16)")
    parser.add_argument(
        "--modes",
        type=names_arg(MODES),
        default="buffered,direct",
        help="comma-separated: buffered (the page cache), fsync, direct (O_DIRECT) (%(default)s)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs; the best is kept (default 3)")
    parser.add_argument(
        "--seals",
        type=names_arg(SEALS),
        default="",
        help="comma-separated: signed, encrypted: also run the engine with integrity keys",
    )
    add_json_argument(parser)
    args = parser.parse_args(argv)
    if args.dir is not None and not args.dir.is_dir():
        parser.error(f"--dir: {args.dir} is not a directory (give one on the disk to measure)")
    report, seals, values = open_report(parser, args, "file_tier", argv), args.seals, {}
    title = f"File tier GB/s vs a raw thread pool and aiofiles, {args.concurrency} in flight, best of {args.repeats}"
    table = Table(title=title)
    columns = ["block", "mode", "op", "engine", "raw", "vs raw", "rounds", "check", "aiofiles", "vs it"]
    columns.append("handoff us/job")
    for seal in seals:
        columns += [seal, "vs engine"]
    for column in columns:
        table.add_column(column, justify="left" if column in ("block", "mode", "op") else "right")
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="tiering-bench-") as base:
        for size in args.block_sizes:
            for mode in args.modes:
                moved, runs = measure(
                    size, args.total_mib << 20, Path(base), args.concurrency, mode, args.job_blocks, args.repeats, seals
                )
                for direction in ("store", "load"):
                    table.add_row(format_size(size), mode, direction, *row_cells(moved, runs, direction, seals))
                values[f"{size} {mode}"] = {"bytes moved": moved, "seconds": runs}
    report.print(table, values, width=132 + 22 * len(seals))  # eleven columns or more: wider than 80
    report.write()


if __name__ == "__main__":
    main()
