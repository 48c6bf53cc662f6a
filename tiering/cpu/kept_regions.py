"""Regions kept for adoption: the files of CPU tiers that outlive their engine
(``cpu_tier: {survive_crash: true}``), found, claimed and swept by later engine starts.

Once every process of an engine maps its region, the region's file gets a kept name,
``tiering-<instance id>-<random>.kvkept`` (`keep`), and loses its instance name, so that a restarted
engine, whose instance id is new, can find it. While any process of the engine lives, its
locks (`tiering.cpu.region_locks`) say so. When none does, the file is abandoned:

- An engine starting with the same geometry and compatibility digest (identity and weights,
  `tiering.cpu.row_records`) claims it (`claim`), if the file is its own user's and nobody
  else may write it (another user who could plant or alter a region's rows and records is
  never trusted): it takes the file's exclusive lock (proof
  that no process of the old engine lives), checks the header, holds its role, gives the file
  its own instance name (the other processes of the engine join it there, as they would a new
  region) and removes the kept name, so no one else can claim it.
- A kept file of the engine's digest but of another format or geometry is discarded (logged).
- Any other abandoned kept file is stamped with the time an engine start first found it
  abandoned, and removed `ABANDONED_TTL_S` after that (`sweep`, at every engine start): its own
  engine may still come back, but shared memory is not held for ever.

A crash during a claim leaves the file under its kept name (claimed again later) or under the
new instance name alone, a leftover every engine start removes (`SharedOffloadRegion.remove_stale`):
the restarted engine is then cold, never wrong.

Thread: the thread that builds the engine or a worker.
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat
import struct
import time
from pathlib import Path

from tiering.cpu.region_locks import hold_role, is_current, take_abandoned
from tiering.cpu.row_records import HEADER, HEADER_BYTES, Geometry, Header, read_header

logger = logging.getLogger(__name__)

KEPT_SUFFIX = ".kvkept"
ABANDONED_TTL_S = 3600.0
"""Seconds an abandoned kept region of another engine is left for that engine to come back."""
_ABANDONED_AT = HEADER.size - 8  # the header's last field


def keep(path: Path, fd: int) -> Path | None:
    """Give the live region `fd`, named `path`, a kept name, and remove `path`; returns the
    kept name (None: `path` no longer names it). Raises nothing but `OSError` from the links."""
    if not is_current(path, fd):
        return None
    kept = path.with_name(f"{path.stem}-{os.urandom(4).hex()}{KEPT_SUFFIX}")
    os.link(path, kept)
    os.unlink(path)
    return kept


def claim(shm_dir: Path, geometry: Geometry, digest: bytes, instance_path: Path, role: int) -> int | None:
    """Claim an abandoned kept region of `geometry` and `digest` for the engine whose region
    is to be `instance_path`, holding `role` (see the module docstring). Returns the file
    descriptor, with a shared `flock` and the role's lock, or None: none to claim (a kept
    file that cannot be read, linked or removed is logged and passed over: the engine starts
    cold rather than not at all). Raises nothing."""
    for path in sorted(shm_dir.glob(f"tiering-*{KEPT_SUFFIX}")):
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:  # gone meanwhile, or another user's
            continue
        try:
            if (
                _trusted(fd)
                and take_abandoned(path, fd)
                and _is_ours(path, fd, geometry, digest)
                and _claim(path, fd, instance_path, role)
            ):
                return fd
        except OSError as exc:
            logger.warning("%s: cannot adopt this kept region (%s)", path, exc)
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    return None


def _trusted(fd: int) -> bool:
    """Whether `fd`'s file is a regular file of this process's user that no one else may write."""
    info = os.fstat(fd)
    return _own(info) and not info.st_mode & 0o022


def _own(info: os.stat_result) -> bool:
    """Whether `info` is of a regular file of this process's user."""
    return stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid()


def _is_ours(path: Path, fd: int, geometry: Geometry, digest: bytes) -> bool:
    header = _header(fd)
    if header.digest != digest:
        return False
    if header.geometry != geometry:
        logger.warning(
            "%s: a kept region of this engine's weights but of %s, not %s: discarded", path, header.geometry, geometry
        )
        os.unlink(path)
        return False
    return True


def _claim(path: Path, fd: int, instance_path: Path, role: int) -> bool:
    if not hold_role(fd, role):
        return False
    try:
        os.link(path, instance_path)
    except FileExistsError:  # the engine's other process made or claimed one meanwhile: join it
        return False
    os.unlink(path)
    os.pwrite(fd, struct.pack("<d", 0.0), _header_offset(fd) + _ABANDONED_AT)
    fcntl.flock(fd, fcntl.LOCK_SH)  # the role's lock keeps other starts off it meanwhile
    logger.info("%s: adopting the kept region %s of a dead engine", instance_path, path.name)
    return True


def sweep(shm_dir: Path, now: float | None = None) -> list[Path]:
    """Stamp the abandoned kept regions under `shm_dir` with `now` (default: the wall clock)
    where not stamped yet, and remove those stamped over `ABANDONED_TTL_S` seconds before, or
    whose header is not of this format; files of another user, and links, are left alone.
    Returns the removed paths. Raises nothing."""
    now = time.time() if now is None else now
    removed = []
    for path in shm_dir.glob(f"tiering-*{KEPT_SUFFIX}"):
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            if not _own(os.fstat(fd)) or not take_abandoned(path, fd):
                continue
            header = _header(fd)
            if header.geometry is not None and header.abandoned_at == 0:
                os.pwrite(fd, struct.pack("<d", now), _header_offset(fd) + _ABANDONED_AT)
            elif header.geometry is None or now - header.abandoned_at > ABANDONED_TTL_S:
                logger.info("%s: a kept region nobody came back for: removed", path)
                os.unlink(path)
                removed.append(path)
        except OSError:
            logger.warning("%s: cannot sweep this kept region", path, exc_info=True)
        finally:
            os.close(fd)
    return removed


def _header_offset(fd: int) -> int:
    return max(0, os.fstat(fd).st_size - HEADER_BYTES)


def _header(fd: int) -> Header:
    return read_header(os.pread(fd, HEADER.size, _header_offset(fd)))
