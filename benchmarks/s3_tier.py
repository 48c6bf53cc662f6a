"""S3 tier GB/s against a bare aiobotocore loop on the same server, side by side.

Both move the same blocks (the same object bytes: header and payload) to the same bucket
at the same concurrency, with the same client settings; interleaved `--repeats` times after
an untimed round, best kept:

- engine: an `s3` tier fed store jobs of `--job-blocks` blocks, then load jobs back into
  page-aligned rows, timed from the first submission to the last result;
- raw: ``put_object`` of pre-joined bytes and ``get_object`` + ``read()`` under an
  ``asyncio.Semaphore``, nothing else (no checksum, no index, no copy into rows).

Without ``--endpoint-url`` it starts a local moto server (``moto[server]``); pass the URL of a
real S3-compatible server to measure that instead (credentials from the AWS chain).
Needs the ``bench-s3`` extra (aiobotocore and moto):

    pip install -c constraints.txt -e '.[bench-s3]'
    python -m tiering.benchmarks.s3_tier --total-mib 128
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time
import uuid

import numpy as np
from rich.table import Table

from tiering.benchmarks.args import format_size, sizes_arg
from tiering.benchmarks.extras import missing_extra
from tiering.benchmarks.json_report import add_json_argument, open_report

try:
    import moto  # noqa: F401  (the local server)
    from aiobotocore.session import get_session
    from botocore.config import Config
except ModuleNotFoundError as missing:
    raise missing_extra("bench-s3", missing) from None

from tiering import make_offload_key
from tiering.benchmarks.file_tier import aligned_rows
from tiering.benchmarks.tier_jobs import add_job_arguments, interleaved, run_tier_jobs
from tiering.tiers.object_format import encode_object


def run_engine(rows: np.ndarray, endpoint: str, bucket: str, concurrency: int, job_blocks: int) -> dict[str, float]:
    config = {"type": "s3", "bucket": bucket, "prefix": f"engine-{uuid.uuid4().hex[:8]}/", "endpoint_url": endpoint}
    return run_tier_jobs(rows, {**config, "max_concurrency": concurrency}, job_blocks)


async def run_raw(rows: np.ndarray, endpoint: str, bucket: str, concurrency: int) -> dict[str, float]:
    prefix = f"raw-{uuid.uuid4().hex[:8]}/"
    config = Config(
        max_pool_connections=concurrency,
        retries={"mode": "standard", "max_attempts": 3},
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    bodies = []
    for i, row in enumerate(rows):
        key = make_offload_key(i.to_bytes(16, "big"), 0)
        bodies.append(b"".join(encode_object(key, memoryview(row), b"\0" * 16)))
    limit = asyncio.Semaphore(concurrency)
    async with get_session().create_client("s3", endpoint_url=endpoint, config=config) as client:

        async def put(i: int) -> None:
            async with limit:
                await client.put_object(Bucket=bucket, Key=f"{prefix}{i}", Body=bodies[i])

        async def get(i: int) -> None:
            async with limit:
                response = await client.get_object(Bucket=bucket, Key=f"{prefix}{i}")
                async with response["Body"] as body:
                    await body.read()

        seconds = {}
        for direction, op in (("store", put), ("load", get)):
            start = time.perf_counter()
            await asyncio.gather(*(op(i) for i in range(len(rows))))
            seconds[direction] = time.perf_counter() - start
    return seconds


def measure(
    block_bytes: int, total_bytes: int, endpoint: str, bucket: str, concurrency: int, job_blocks: int, repeats: int
) -> tuple[int, dict[str, list[float]]]:
    """(bytes moved per run, each round's seconds of each side and direction)."""
    rows = aligned_rows(max(total_bytes // block_bytes, job_blocks), block_bytes)
    sides = [
        ("engine", lambda: run_engine(rows, endpoint, bucket, concurrency, job_blocks)),
        ("raw", lambda: asyncio.run(run_raw(rows, endpoint, bucket, concurrency))),
    ]
    return rows.nbytes, interleaved(sides, repeats)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endpoint-url", default=None, help="S3-compatible endpoint (default: start a local moto)")
    parser.add_argument("--bucket", default=None, help="bucket to use (default: a new one)")
    parser.add_argument("--block-sizes", type=sizes_arg, default="2MiB,256KiB", help="comma-separated (%(default)s)")
    add_job_arguments(parser, 3, "interleaved runs; the best is kept")
    add_json_argument(parser)
    args = parser.parse_args(argv)
    report, values = open_report(parser, args, "s3_tier", argv), {}
    with contextlib.ExitStack() as stack:
        endpoint, bucket = args.endpoint_url, args.bucket
        if endpoint is None:
            from tiering.testing.s3_server import MotoServer

            for name, value in (
                ("AWS_ACCESS_KEY_ID", "bench"),
                ("AWS_SECRET_ACCESS_KEY", "bench"),
                ("AWS_DEFAULT_REGION", "us-east-1"),
                ("AWS_EC2_METADATA_DISABLED", "true"),
            ):
                os.environ.setdefault(name, value)
            server = MotoServer()
            server.start()
            stack.callback(server.stop)
            endpoint = server.endpoint_url
        if bucket is None:
            bucket = f"tiering-bench-{uuid.uuid4().hex[:8]}"
            asyncio.run(_create_bucket(endpoint, bucket))
        table = Table(
            title=f"S3 tier vs bare aiobotocore at {endpoint}, {args.concurrency} in flight, best of {args.repeats}"
        )
        for column in ("block", "direction", "engine GB/s", "raw GB/s", "ratio"):
            table.add_column(column, justify="left" if column in ("block", "direction") else "right")
        for size in args.block_sizes:
            moved, runs = measure(
                size,
                args.total_mib << 20,
                endpoint,
                bucket,
                args.concurrency,
                args.job_blocks,
                args.repeats,
            )
            values[size] = {"bytes moved": moved, "seconds": runs}
            for direction in ("store", "load"):
                engine = moved / min(runs[f"engine {direction}"])
                raw = moved / min(runs[f"raw {direction}"])
                rates = (f"{engine / 1e9:.3f}", f"{raw / 1e9:.3f}", f"{engine / raw:.2f}x")
                table.add_row(format_size(size), direction, *rates)
    report.print(table, values)
    report.write()


async def _create_bucket(endpoint: str, bucket: str) -> None:
    async with get_session().create_client("s3", endpoint_url=endpoint) as client:
        await client.create_bucket(Bucket=bucket)


if __name__ == "__main__":
    main()
