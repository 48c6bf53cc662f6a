"""Mooncake tier GB/s against the bare Mooncake client on the same pool, and beside them the
Valkey tier against bare valkey-glide, all interleaved round by round.

Every side moves the same blocks (header and payload) at the same concurrency; interleaved
`--repeats` times after an untimed round:

- mooncake engine: a ``mooncake`` tier (a client contributing no memory, its default
  threads, calls in flight and batches) fed store jobs of `--job-blocks` blocks, then load
  jobs back into page-aligned rows, timed from the first submission to the last result
  (checksum checked);
- mooncake raw: the client's ``batch_upsert_from`` and ``batch_get_into`` from and into one
  registered buffer of pre-encoded objects, `--concurrency` blocks per call on as many
  threads, nothing else (no header written, no checksum, no index, no copy into rows);
- valkey engine and raw (``--valkey``, the default): as `tiering.benchmarks.valkey_tier`, on a
  local redis-server.

Two ratios per tier: best engine run over best raw run, and the median over rounds of the
ratio of the two runs of a round, with the lowest and highest of those ratios.

The pool is a local ``mooncake_master`` with one ``mooncake_client`` member mounting
`--segment` of memory, in a network namespace of its own (`tiering.testing.mooncake_pool`:
root only). Needs the ``bench-mooncake`` extra, and ``bench-valkey`` for the Valkey sides:

    pip install -c constraints.txt -e '.[bench-mooncake,bench-valkey]'
    python -m tiering.benchmarks.mooncake_tier --block-sizes 64KiB,2MiB
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import statistics
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from rich.table import Table

from tiering.benchmarks.args import format_size, sizes_arg
from tiering.benchmarks.extras import missing_extra
from tiering.benchmarks.json_report import add_json_argument, open_report

try:
    from mooncake.store import MooncakeDistributedStore
except ImportError as missing:
    raise missing_extra("bench-mooncake", missing) from None

from tiering import make_offload_key
from tiering.benchmarks.file_tier import aligned_rows
from tiering.benchmarks.tier_jobs import add_job_arguments, interleaved, run_tier_jobs
from tiering.options import parse_size
from tiering.testing.mooncake_pool import MooncakePool, unavailable
from tiering.tiers.network_namespace import enter_network_namespace
from tiering.tiers.object_format import encode_object

Side = tuple[str, Callable[[], Mapping[str, float]]]


def run_engine(rows: np.ndarray, pool: MooncakePool, job_blocks: int) -> dict[str, float]:
    """Seconds a ``mooncake`` tier of a fresh key prefix (its default threads, calls and
    batches) takes to store, then load, `rows`."""
    options = {"segment_bytes": 0, "key_prefix": f"engine-{uuid.uuid4().hex[:8]}"}
    return run_tier_jobs(rows, {"type": "mooncake", **pool.tier_options(**options)}, job_blocks)


class RawClient:
    """A bare Mooncake client in the pool's namespace, with one registered buffer that holds
    every row's object (header and payload, encoded once) and one for reading them back."""

    def __init__(self, rows: np.ndarray, pool: MooncakePool, concurrency: int):
        self.concurrency = concurrency
        keys = [make_offload_key(i.to_bytes(16, "big"), 0) for i in range(len(rows))]
        pairs = zip(keys, rows, strict=True)
        objects = [b"".join(encode_object(key, memoryview(row), b"\0" * 16)) for key, row in pairs]
        self.size = len(objects[0])
        self.source = np.frombuffer(b"".join(objects), np.uint8).copy()
        self.target = np.zeros_like(self.source)
        namespace = (pool.namespace.path,)
        self.executor = ThreadPoolExecutor(concurrency, initializer=enter_network_namespace, initargs=namespace)
        self.store = MooncakeDistributedStore()
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")  # as the tier's client sets it
        self._do(
            lambda: self.store.setup("127.0.0.1", pool.metadata_server, 0, 16 << 20, "tcp", "", pool.master_address)
        )
        for buffer in (self.source, self.target):
            self._do(self.store.register_buffer, buffer.ctypes.data, buffer.nbytes)

    def _do(self, call: Callable[..., int], *args: object) -> None:
        status = self.executor.submit(call, *args).result()
        if status != 0:
            raise OSError(f"Mooncake status {status}")

    def run(self) -> dict[str, float]:
        """Seconds to upsert every object, then read it back, `concurrency` per call at once."""
        prefix = f"raw-{uuid.uuid4().hex[:8]}:"
        count = len(self.source) // self.size
        batches = [range(start, min(start + self.concurrency, count)) for start in range(0, count, self.concurrency)]

        def put(batch: range) -> list[int]:
            names = [f"{prefix}{i}" for i in batch]
            addresses = [self.source.ctypes.data + i * self.size for i in batch]
            return list(self.store.batch_upsert_from(names, addresses, [self.size] * len(batch)))

        def get(batch: range) -> list[int]:
            names = [f"{prefix}{i}" for i in batch]
            addresses = [self.target.ctypes.data + i * self.size for i in batch]
            return list(self.store.batch_get_into(names, addresses, [self.size] * len(batch)))

        seconds = {}
        for direction, op, expected in (("store", put, 0), ("load", get, self.size)):
            start = time.perf_counter()
            statuses = [status for result in self.executor.map(op, batches) for status in result]
            seconds[direction] = time.perf_counter() - start
            if any(status != expected for status in statuses):
                raise OSError(f"raw {direction}: Mooncake statuses {sorted(set(statuses))}")
        self._do(lambda: min(0, self.store.remove_by_regex(f"^{prefix}", True)))  # a count, or an error
        return seconds

    def close(self) -> None:
        self.executor.submit(self.store.close).result()
        self.executor.shutdown()


def valkey_sides(rows: np.ndarray, address: str, concurrency: int, job_blocks: int) -> list[Side]:
    """The Valkey tier and bare glide on the server at `address` (`tiering.benchmarks.valkey_tier`)."""
    from tiering.benchmarks import valkey_tier

    return [
        ("valkey engine", lambda: valkey_tier.run_engine(rows, [address], False, concurrency, job_blocks)),
        ("valkey raw", lambda: asyncio.run(valkey_tier.run_raw(rows, [address], False, concurrency))),
    ]


def ratios_row(block: int, direction: int | str, size: int, engine: list[float], raw: list[float]) -> tuple[str, ...]:
    """A table row: GB/s of both sides' best runs, best over best, median paired ratio."""
    paired = [r / e for e, r in zip(engine, raw, strict=True)]
    return (
        format_size(block),
        str(direction),
        f"{size / min(engine) / 1e9:.3f}",
        f"{size / min(raw) / 1e9:.3f}",
        f"{min(raw) / min(engine):.2f}x",
        f"{statistics.median(paired):.2f}x",
        f"{min(paired):.2f}-{max(paired):.2f}x",
    )


def main(argv: list[str] | None = None) -> None:
    """The command line (see the module docstring): prints the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-sizes", type=sizes_arg, default="64KiB,2MiB", help="comma-separated (%(default)s)")
    parser.add_argument("--segment", type=parse_size, default=1 << 30, help="the pool's memory (default 1GiB)")
    parser.add_argument("--no-valkey", dest="valkey", action="store_false", help="the Mooncake sides only")
    add_job_arguments(parser, 5, "interleaved rounds")
    add_json_argument(parser)
    args = parser.parse_args(argv)
    report, values = open_report(parser, args, "mooncake_tier", argv), {}
    why = unavailable()
    if why:
        parser.error(why)
    title = f"Mooncake and Valkey tiers vs their bare clients, {args.concurrency} in flight, {args.repeats} rounds"
    table = Table(title=title)
    for column in ("block", "tier / direction", "engine GB/s", "raw GB/s", "best / best", "median of rounds", "rounds"):
        table.add_column(column, justify="left" if column in ("block", "tier / direction") else "right")
    with contextlib.ExitStack() as stack:
        pool = MooncakePool(args.segment)
        stack.callback(pool.stop)
        address = None
        if args.valkey:
            from tiering.testing.valkey_server import ValkeyServer

            server = ValkeyServer()
            stack.callback(server.stop)
            server.start()
            address = server.address
        for block_size in args.block_sizes:
            rows = aligned_rows(max((args.total_mib << 20) // block_size, args.job_blocks), block_size)
            raw = RawClient(rows, pool, args.concurrency)
            try:
                sides: list[Side] = [
                    ("mooncake engine", functools.partial(run_engine, rows, pool, args.job_blocks)),
                    ("mooncake raw", raw.run),
                ]
                if address is not None:
                    sides += valkey_sides(rows, address, args.concurrency, args.job_blocks)
                runs = interleaved(sides, args.repeats)
            finally:
                raw.close()
            values[block_size] = {"bytes moved": rows.nbytes, "seconds": runs}
            for tier in ("mooncake", "valkey") if address else ("mooncake",):
                for direction in ("store", "load"):
                    engine, bare = runs[f"{tier} engine {direction}"], runs[f"{tier} raw {direction}"]
                    table.add_row(*ratios_row(block_size, f"{tier} {direction}", rows.nbytes, engine, bare))
    report.print(table, values)
    report.write()


if __name__ == "__main__":
    main()
