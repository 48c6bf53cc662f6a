"""What the benchmark CLIs (``tiering-bench`` and its subcommands, the micro-benchmarks) share on
their command lines: argument types that reject bad values with one clear line before any
work, sizes printed one way, and the check that an output path can be written before a run
starts.

Thread: the CLI's.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Iterable
from pathlib import Path

from tiering.eviction.retention import retention_s
from tiering.options import DURATION_EXAMPLES, parse_duration, parse_size


def size_arg(text: str) -> int:
    """A size such as ``8GiB`` (`tiering.options.parse_size`), bytes."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def sizes_arg(text: str) -> list[int]:
    """Comma-separated sizes such as ``64KiB,2MiB``, bytes each."""
    parts = [part.strip() for part in text.split(",")]
    try:
        sizes = [parse_size(part) for part in parts]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return sizes


def duration_arg(text: str) -> float:
    """A positive duration (`tiering.options.parse_duration`: ``90s``, ``36h``, ``P2W``,
    seconds), in seconds: the one grammar of durations, as in configs and hints."""
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


DURATION_HELP = f"a duration: {DURATION_EXAMPLES}"
"""How a ``duration_arg`` option's help says what it takes."""


def names_arg(choices: Iterable[str]) -> Callable[[str], list[str]]:
    """An argument type for a comma-separated list of names out of `choices` (an empty text
    is an empty list)."""
    allowed = tuple(choices)

    def parse(text: str) -> list[str]:
        names = [part.strip() for part in text.split(",") if part.strip()]
        unknown = [name for name in names if name not in allowed]
        if unknown:
            raise argparse.ArgumentTypeError(f"expected names out of {', '.join(allowed)}; got {', '.join(unknown)}")
        return names

    return parse


def format_size(count: float) -> str:
    """`count` bytes in the largest binary unit that keeps it at or above 1: ``64 KiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024:
            return f"{count:.0f} {unit}"
        count /= 1024
    return f"{count:.1f} TiB"


HINTS = "none, continuation, release or retain:DURATION (5m, 1h, P1D or seconds, as a client's hint takes it)"
"""What every benchmark's ``--hints`` takes (`parse_hints`)."""


def parse_hints(text: str) -> tuple[str, float | None]:
    """A ``--hints`` value: ``("none" | "continuation" | "release", None)`` or ``("retain",
    seconds)``; the retention hints of `tiering.eviction.retention`, the duration parsed as a
    client's is.

    Raises:
        ValueError: not one of `HINTS`.
    """
    if text in ("none", "continuation", "release"):
        return text, None
    kind, _, duration = text.partition(":")
    if kind == "retain" and duration:
        try:
            return "retain", retention_s(duration)
        except ValueError as exc:
            raise ValueError(f"retain:DURATION: {exc}") from None
    raise ValueError(f"expected {HINTS}; got {text!r}")


def checked(check: Callable[[str], object]) -> Callable[[str], str]:
    """An argument type taking a text that `check` accepts, as given (`check` raising
    ValueError makes argparse's one-line error)."""

    def parse(text: str) -> str:
        try:
            check(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text

    return parse


hints_arg = checked(parse_hints)
"""A ``--hints`` value, checked (`parse_hints`), as given."""


def natural_arg(text: str) -> int:
    """An integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def positive_arg(text: str) -> int:
    """An integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def count_arg(text: str) -> int:
    """An integer >= 0, digits only."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return int(text)


def rate_arg(text: str) -> float:
    """A finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def port_arg(text: str) -> int:
    """A TCP port, 0..65535."""
    if not text.isdigit() or not 0 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port 0..65535, got {text!r}")
    return int(text)


def check_output(path: Path | None, option: str) -> None:
    """Fail before the run, not after it, if `path` cannot be written; remove what an
    earlier run wrote there, so that a run that ends early never leaves an old file that
    looks like its own.

    Raises:
        ValueError: `path` is a directory, or its directory is missing or not writable.
    """
    if path is None:
        return
    parent = path.parent
    if path.is_dir():
        raise ValueError(f"{option} {path} is a directory; expected a file name")
    if not parent.is_dir():
        raise ValueError(f"{option} {path}: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{option} {path}: the directory {parent} is not writable")
    path.unlink(missing_ok=True)
