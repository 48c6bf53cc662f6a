"""What a benchmark needs beyond the `bench` extra, said in one line when it is missing."""

from __future__ import annotations


def missing_extra(extra: str, error: ModuleNotFoundError) -> SystemExit:
    """The exit of a benchmark whose import of a third-party module failed with `error`: one
    line naming the module and the pip command that installs `extra` (from the repository's root)."""
    package = (error.name or "?").partition(".")[0]
    return SystemExit(
        f"this benchmark needs the '{extra}' extra (no module named {package!r}): "
        f"pip install -c constraints.txt -e '.[{extra}]'"
    )
