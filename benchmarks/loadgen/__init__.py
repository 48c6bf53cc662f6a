"""`tiering-bench`, the load generator: replays a request trace through the real engine.

Thread: a command-line tool; the main thread is the scheduler.
"""

from __future__ import annotations

import sys

BENCH_MODULES = ("rich", "torch", "matplotlib", "prometheus_client")  # what the ``bench`` extra installs


def main(argv: list[str] | None = None) -> int:
    """The ``tiering-bench`` command: a trace replay, ``tiering-bench overload ...`` (an
    offered store rate ramped past what a tier absorbs, see `tiering.benchmarks.overload`),
    or ``tiering-bench serve ...`` (a real vLLM server, see `tiering.benchmarks.serve`).
    Without the ``bench`` extra it says what to install and exits 2 instead of failing on
    an import."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv[:1] == ["overload"]:
            from tiering.benchmarks import overload

            return overload.main(argv[1:])
        if argv[:1] == ["serve"]:
            from tiering.benchmarks.serve import cli as serve

            return serve.main(argv[1:])
        from tiering.benchmarks.loadgen import cli

        return cli.main(argv)
    except ImportError as exc:
        missing = (exc.name or "").partition(".")[0]
        if missing not in BENCH_MODULES:
            raise
        print(
            f"tiering-bench needs the 'bench' extra ({missing} is not installed): pip install 'kv-tiering[bench]'",
            file=sys.stderr,
        )
        return 2
