"""``--json FILE``, shared by every benchmark: the tables for people on the terminal, the same
results for scripts (and for the docs' numbers) in one JSON document.

The document::

    {"benchmark": "scheduler_cost", "argv": [...], "commit": "4cf40a1...", "dirty": false,
     "cpus": 2, "python": "3.11.9", "started": "2026-11-29T14:40:00+00:00",
     "tables": [{"title": ..., "columns": [...], "rows": [{column: cell, ...}, ...],
                 "values": <the numbers behind the table: each round's, in seconds or bytes>}]}

``commit`` is the repository's HEAD where the code runs from a git checkout (``dirty`` when
its tracked files differ from it), else None. ``FILE`` ``-`` writes to standard output, and
the tables then go to standard error, so that the output parses as it is.

Thread: the CLI's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from tiering.benchmarks.args import check_output

JSON_HELP = "also write the results as JSON to FILE, each round's values with the commit and CPU count ('-': stdout)"


def add_json_argument(parser: argparse.ArgumentParser) -> None:
    """The ``--json FILE`` option (None when not given)."""
    parser.add_argument("--json", type=Path, metavar="FILE", default=None, help=JSON_HELP)


def open_report(
    parser: argparse.ArgumentParser, args: argparse.Namespace, benchmark: str, argv: list[str] | None
) -> Report:
    """The `Report` of a run whose command line `argv` (None: the process's) `parser` parsed
    into `args`; exits through ``parser.error`` (status 2) before any work if ``--json``'s
    FILE cannot be written."""
    if args.json is not None and str(args.json) != "-":
        try:
            check_output(args.json, "--json")
        except ValueError as exc:
            parser.error(str(exc))
    return Report(benchmark, args.json, argv)


def source_commit() -> tuple[str | None, bool]:
    """(HEAD's commit, whether tracked files differ from it) of the checkout this code runs
    from, or (None, False) outside a git checkout or without git."""
    here = Path(__file__).resolve().parent

    def git(*arguments: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", *arguments], cwd=here, capture_output=True, text=True, timeout=10)

    try:
        head = git("rev-parse", "HEAD")
        status = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.TimeoutExpired):
        return None, False
    if head.returncode != 0:
        return None, False
    return head.stdout.strip(), bool(status.stdout.strip())


def provenance() -> dict[str, Any]:
    """Where numbers come from: ``commit`` and ``dirty`` (`source_commit`), ``cpus`` (the
    machine's CPU count) and ``python`` (its version)."""
    commit, dirty = source_commit()
    return {"commit": commit, "dirty": dirty, "cpus": os.cpu_count(), "python": platform.python_version()}


def _plain(value: Any) -> Any:
    """`value` with tuple keys joined by spaces and other non-JSON keys as strings."""
    if isinstance(value, dict):
        return {" ".join(map(str, k)) if isinstance(k, tuple) else str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    return value


class Report:
    """The tables a benchmark prints, kept for ``--json``.

    `path`: the ``--json`` argument (None: print only; ``-``: the JSON to stdout and the
    tables to stderr). `benchmark`: the benchmark's name in the document.
    """

    def __init__(self, benchmark: str, path: Path | None, argv: list[str] | None = None):
        self.path = path
        self._document: dict[str, Any] = {
            "benchmark": benchmark,
            "argv": list(sys.argv[1:] if argv is None else argv),
            **(provenance() if path is not None else {}),
            "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "tables": [],
        }
        self._to_stderr = path is not None and str(path) == "-"

    def console(self, width: int = 100) -> Console:
        """Where a benchmark prints for people: stdout, or stderr under ``--json -``; at
        least `width` columns wide."""
        return Console(stderr=self._to_stderr, width=max(Console().width, width))

    def print(self, table: Table, values: Any = None, width: int = 100) -> None:
        """Print `table` (at least `width` columns wide) and keep it, with `values` (the numbers
        behind it: dicts, lists and numbers; tuple keys become strings of their parts)."""
        self.console(width).print(table)
        columns: list[str] = []
        for column in table.columns:  # a heading used twice is named with its count: "vs it 2"
            heading = str(column.header)
            columns.append(f"{heading} {columns.count(heading) + 1}" if heading in columns else heading)
        cells = [[str(cell) for cell in column.cells] for column in table.columns]
        rows = [dict(zip(columns, row, strict=True)) for row in zip(*cells, strict=True)]
        entry = {"title": str(table.title or ""), "columns": columns, "rows": rows, "values": _plain(values)}
        self._document["tables"].append(entry)

    def add(self, name: str, value: Any) -> None:
        """Keep `value` under `name` at the document's top level (a benchmark's own summary)."""
        self._document[name] = _plain(value)

    def write(self) -> None:
        """Write the document to ``--json``'s FILE (nothing without one).

        Raises:
            OSError: the file cannot be written.
        """
        if self.path is None:
            return
        text = json.dumps(self._document, indent=1)
        if str(self.path) == "-":
            sys.stdout.write(text + "\n")
        else:
            self.path.write_text(text + "\n")
