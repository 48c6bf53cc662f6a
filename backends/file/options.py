"""The ``file`` tier's config keys (`FileOptions`), `root_dir` checked where the config is
loaded (`check_root_dir`).

Thread: where the config is loaded.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel

from tiering.backends.file import dirs
from tiering.options import STRICT, Count


def check_root_dir(value: str) -> str:
    """`root_dir` as a config value, checked at load, with ``~`` expanded: not empty; an
    existing directory that is private to the engine's user and writable, or creatable under
    a writable directory.

    Raises:
        ValueError: what is wrong, naming the path.
    """
    if not value:
        raise ValueError("must not be empty")
    value = os.path.expanduser(value)
    if value.startswith("~"):
        raise ValueError(f"{value}: no such user's home directory to expand '~' to")
    path = Path(value)
    try:
        info = os.stat(path)
    except FileNotFoundError:
        parent = path.absolute().parent
        while not os.path.lexists(parent):
            parent = parent.parent
        if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
            raise ValueError(f"{path} cannot be created: {parent} is not a writable directory") from None
        return value
    except OSError as exc:
        raise ValueError(f"{path} cannot be used: {exc.strerror}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise ValueError(f"{path} is not a directory")
    try:
        dirs.check_root(info, path)
    except PermissionError as exc:
        raise ValueError(exc.strerror) from None
    return value


RootDir = Annotated[str, AfterValidator(check_root_dir)]


class FileOptions(BaseModel):
    """Config keys of the ``file`` tier, besides every block-store tier's.

    Attributes:
        root_dir: the directory holding the tier's files (required; see `check_root_dir`).
        io_threads: threads of each of the tier's two pools, one for writes and deletes, one
            for reads (default: the tier's `max_concurrency`; segments are read by at most
            `segments.SEGMENT_READ_THREADS`).
        fsync: `fsync` every file before it becomes visible (durable across power loss).
        direct_io: bypass the page cache with O_DIRECT where the filesystem allows.
        layout: ``auto`` (default), ``files`` (one file per block; engines may share the
            directory) or ``segments`` (many blocks per file, one engine's:
            `tiering.backends.file.segments`). ``auto`` keeps blocks under
            `store.SEGMENT_BLOCKS_UNDER` in segments, except where the filesystem cannot punch
            holes, where the namespace already holds one-file objects (an older cache, or
            engines sharing the directory) and where another engine holds its segments: there,
            and for larger blocks, one file per block (the log says which and why).
        shared: the directory is shared with other engines (a network filesystem, or
            replicas on one machine): one file per block (``layout: auto`` settles on
            ``files``; ``segments`` is refused), so that engines find each other's blocks
            by name (with ``probe_misses``), and the tier's KV events call its blocks
            `REMOTE`, not `LOCAL` (`tiering.tiers.events`).
    """

    model_config = STRICT

    root_dir: RootDir
    io_threads: Count | None = None
    fsync: bool = False
    direct_io: bool = True
    layout: Literal["auto", "files", "segments"] = "auto"
    shared: bool = False
