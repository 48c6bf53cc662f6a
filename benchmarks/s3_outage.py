"""How fast a frozen S3 endpoint is noticed: the s3 tier (default options) against a bare
aiobotocore client (botocore's default timeouts), side by side, on a local moto server that
is stopped with SIGSTOP (alive, listening, silent), and how soon blocks load again once it
is resumed. Also: how long building a tier against an endpoint that never answers takes to
fail. Needs the ``bench-s3`` extra (aiobotocore and moto):

    pip install -c constraints.txt -e '.[bench-s3]'
    python -m tiering.benchmarks.s3_outage [--limit-s 60] [--outage-s 75]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import time

import numpy as np

from tiering import JobMetadata, ReqContext, SecondaryTierFactory, make_offload_key
from tiering.benchmarks.args import DURATION_HELP, duration_arg
from tiering.benchmarks.extras import missing_extra
from tiering.benchmarks.json_report import add_json_argument, open_report
from tiering.testing.s3_server import MotoServer

try:
    import aiobotocore  # noqa: F401
    import moto  # noqa: F401
except ModuleNotFoundError as missing:
    raise missing_extra("bench-s3", missing) from None

ROWS, ROW_BYTES = 64, 4096
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "benchmark",
    "AWS_SECRET_ACCESS_KEY": "benchmark-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


def make_tier(config: dict):
    view = memoryview(bytearray(ROWS * ROW_BYTES)).cast("B", (ROWS, ROW_BYTES))
    return SecondaryTierFactory.create_secondary_tier(config, view, None)


def tier_outage(server: MotoServer, limit_s: float, outage_s: float) -> tuple[float | None, float | None]:
    """(seconds from the freeze to the breaker opening, seconds from the server's return to
    the first block loaded again), one store job every 50 ms as a busy engine sends them, the
    server frozen for `outage_s` seconds; None: not within `limit_s`."""
    tier = make_tier({"type": "s3", "bucket": "outage", "endpoint_url": server.endpoint_url})
    context, job, frozen = ReqContext("benchmark"), 0, False

    def step(keys: list | None = None, row: int = 2, promotion: bool = False) -> list:
        """One 50 ms scheduler step submitting one job (by default the store of a new block)."""
        nonlocal job
        keys = keys or [make_offload_key(job.to_bytes(8, "big"), 0)]
        new = JobMetadata(job, keys, np.array([row]), promotion, context)
        job += 1
        (tier.submit_load if promotion else tier.submit_store)(new)
        tier.on_schedule_end()
        time.sleep(0.05)
        return list(tier.get_finished())

    try:
        kept = make_offload_key(bytes(8), 0)
        step([kept], row=0)
        while not tier.lookup(kept, context):
            step([kept], row=0)
        os.kill(server.pid, signal.SIGSTOP)
        frozen, start = True, time.monotonic()
        while tier.health.healthy and time.monotonic() - start < limit_s:
            step()
        to_breaker = None if tier.health.healthy else time.monotonic() - start
        while time.monotonic() - start < outage_s:
            step()
        os.kill(server.pid, signal.SIGCONT)
        frozen, back = False, time.monotonic()
        while time.monotonic() - back < limit_s:
            if tier.lookup(kept, context):
                load = job
                done = step([kept], row=1, promotion=True)
                while not any(result.job_id == load for result in done):
                    done = step()
                if next(result for result in done if result.job_id == load).success:
                    return to_breaker, time.monotonic() - back
            else:
                step()
        return to_breaker, None
    finally:
        if frozen:
            os.kill(server.pid, signal.SIGCONT)
        tier.shutdown()


async def raw_seconds_to_error(server: MotoServer, limit_s: float) -> float | None:
    """Seconds until a bare `put_object` (botocore's defaults) fails against the frozen server."""
    from aiobotocore.session import get_session

    async with get_session().create_client("s3", endpoint_url=server.endpoint_url) as client:
        os.kill(server.pid, signal.SIGSTOP)
        start = time.monotonic()
        try:
            await asyncio.wait_for(client.put_object(Bucket="outage", Key="k", Body=b"x" * 4096), limit_s)
        except TimeoutError:
            return None
        except Exception:
            return time.monotonic() - start
        finally:
            os.kill(server.pid, signal.SIGCONT)
    return None


def silent_endpoint_seconds() -> tuple[float, str]:
    """Seconds until building a tier against an endpoint that accepts and never answers fails."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        start = time.monotonic()
        try:
            make_tier({"type": "s3", "bucket": "b", "endpoint_url": f"http://127.0.0.1:{silent.getsockname()[1]}"})
        except Exception as exc:
            return time.monotonic() - start, f"{type(exc).__name__}: {exc}"
    raise RuntimeError("a tier was built against a silent endpoint")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit-s", type=duration_arg, default=60.0, help=f"give up after this long, {DURATION_HELP}")
    parser.add_argument(
        "--outage-s", type=duration_arg, default=75.0, help=f"how long the endpoint stays frozen, {DURATION_HELP}"
    )
    add_json_argument(parser)
    args = parser.parse_args(argv)
    report = open_report(parser, args, "s3_outage", argv)
    os.environ.update(CREDENTIALS)

    def show(what: str, seconds: float | None) -> None:
        """One line on stderr under ``--json -``; the seconds (None: not within the limit) kept."""
        outcome = f"after {seconds:.1f} s" if seconds is not None else f"not within {args.limit_s:.0f} s"
        report.console().print(f"{what} {outcome}", highlight=False)
        report.add(what, seconds)

    server = MotoServer()
    server.start()
    try:
        server.create_bucket("outage")
        to_breaker, to_recovery = tier_outage(server, args.limit_s, args.outage_s)
        show("frozen endpoint, s3 tier: breaker open", to_breaker)
        show(f"endpoint back after {args.outage_s:.0f} s, s3 tier: a block loaded again", to_recovery)
        show("frozen endpoint, bare aiobotocore put: failed", asyncio.run(raw_seconds_to_error(server, args.limit_s)))
    finally:
        server.stop()
    seconds, message = silent_endpoint_seconds()
    show("silent endpoint, building the tier: failed", seconds)
    report.console().print(f"  {message}", highlight=False, markup=False)
    report.add("silent endpoint error", message)
    report.write()


if __name__ == "__main__":
    main()
