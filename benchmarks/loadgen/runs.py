"""The namespaces `tiering-bench` runs make in file tiers: marked as in use while their run
lives, removed by a later run once it is gone.

A run replays into a fresh namespace and removes it at the end, but a run killed outright
(SIGKILL, a lost machine) leaves it behind. So each run holds an exclusive lock (``flock``)
on a file beside its namespace, ``<namespace>.tiering-bench-run`` holding its pid, for as
long as its process lives: the kernel drops the lock however the process ends. A later run
over the same ``root_dir`` removes every namespace whose lock file it can lock. The scratch
directory a run makes in the temp dir (the built-in default's file tier) is claimed and swept
the same way.

Thread: the main thread of `tiering-bench`.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger("tiering.bench")

SUFFIX = ".tiering-bench-run"


class RunClaim:
    """The locks of one run's namespaces; `release` (at the end of the run) unlocks and
    removes them."""

    def __init__(self) -> None:
        self._held: list[tuple[Path, int]] = []

    def claim(self, namespace: Path) -> None:
        """Lock ``<namespace>.tiering-bench-run`` for this process (created if missing).

        Raises:
            OSError: the lock file cannot be created or locked.
        """
        path = namespace.with_name(namespace.name + SUFFIX)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # at most a sweep's check of a new, empty file in the way
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        except BaseException:
            os.close(fd)
            raise
        self._held.append((path, fd))

    def release(self) -> None:
        """Remove and unlock every lock file held (the namespaces are the caller's)."""
        for path, fd in self._held:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            os.close(fd)
        self._held.clear()


def sweep(root: Path) -> list[Path]:
    """Remove, under `root`, the namespaces of runs that are gone (lock files nobody holds)
    and their lock files; returns the namespaces removed. A namespace that cannot be
    removed is logged and left."""
    removed: list[Path] = []
    try:
        locks = [path for path in root.iterdir() if path.name.endswith(SUFFIX)]
    except OSError:  # no root_dir yet, or not ours to list: nothing of an earlier run
        return removed
    for path in locks:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its run is alive
            if os.fstat(fd).st_size == 0:
                continue  # a run claiming it right now (its pid is written under the lock)
            namespace = path.with_name(path.name.removesuffix(SUFFIX))
            try:
                if namespace.is_dir() and not namespace.is_symlink():
                    shutil.rmtree(namespace)
                    removed.append(namespace)
                path.unlink()
            except OSError as exc:
                logger.warning("could not remove %s, left by an earlier run: %s", namespace, exc)
        finally:
            os.close(fd)
    if removed:
        logger.info("removed %d namespace(s) that earlier runs killed before their end left in %s", len(removed), root)
    return removed


@contextlib.contextmanager
def scratch_directory() -> Iterator[str]:
    """A fresh ``tiering-bench-*`` directory in the temp dir, claimed for this run and removed
    at its end; the ones runs killed before their end left there are swept first.

    Raises:
        OSError: the directory or its lock file cannot be created.
    """
    root = Path(tempfile.gettempdir())
    sweep(root)
    path = Path(tempfile.mkdtemp(prefix="tiering-bench-", dir=root))
    claim = RunClaim()
    try:
        claim.claim(path)
        yield str(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)
        claim.release()
