"""The drain of a graceful stop: the blocks only the CPU tier holds, written to a lasting tier.

The primary tier dies with the engine. Blocks that the admission filter, shedding or
write-back kept from the lasting tiers (`SecondaryTierManager.lasting`) would die with it,
and a restarted engine would compute them again. At `TieringOffloadingManager.shutdown` the
drain writes them, the most valuable first (the primary policy's order, hottest first), to
the first lasting tier with room for them: never more blocks than the tier holds
(`SecondaryTierManager.capacity_blocks`), so no drained block evicts another; what does not
fit goes to the next lasting tier. It writes a wave of the tier's ``max_rows_in_flight`` at
a time (so the hottest are written first), waits for the cascades already in flight too, and
stops after ``shutdown_drain_s`` seconds whatever is left: the stop is never delayed beyond
that. A SIGKILL during the drain loses only the blocks not written yet: a tier's objects are
whole or absent (the file tier writes a temporary file and renames it into place).

Thread: the scheduler thread, from `shutdown` (it blocks, at most the drain's seconds).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tiering.contract.keys import OffloadKey
from tiering.cpu.primary import CPUPrimaryTierOffloadingManager
from tiering.engine.cascades import BACKGROUND, Cascades
from tiering.engine.tier_calls import guarded, overrides
from tiering.tiers.base import SecondaryTierManager

logger = logging.getLogger(__name__)

SHUTDOWN_DRAIN_S = 5.0
"""Seconds a graceful stop spends writing the CPU tier's blocks to the lasting tiers, by default."""

_POLL_S = 0.005  # between two polls of a tier whose `drain` returns at once (no wait of its own)


@dataclass
class DrainReport:
    """What a drain did.

    Attributes:
        candidates: blocks only the primary tier held, idle, when it began.
        assigned: those given to a lasting tier (the others found no room in any).
        written: per lasting tier name, the blocks it holds now of those given to it.
        seconds: how long it took.
    """

    candidates: int
    assigned: int = 0
    written: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def left(self) -> int:
        """Candidates no lasting tier holds: they end with the process, as a cache's blocks
        do (a restart computes them again)."""
        return self.candidates - sum(self.written.values())

    @property
    def no_room(self) -> int:
        """Candidates beyond every lasting tier's room (`capacity_blocks`)."""
        return self.candidates - self.assigned


def drain(
    primary: CPUPrimaryTierOffloadingManager,
    tiers: Sequence[SecondaryTierManager],
    names: Sequence[str],
    cascades: Cascades,
    poll: Callable[[], None],
    seconds: float,
    clock: Callable[[], float] = time.monotonic,
) -> DrainReport | None:
    """Write the primary tier's blocks that no lasting tier holds to the lasting tiers (see
    the module docstring), for at most `seconds`, and log what it did; `poll` hears of the
    jobs that ended.

    Returns:
        What it did, or None where there is nothing to do (no lasting tier, `seconds` 0) or
        it failed: never raises (the failure is logged, and the stop goes on without it).
    """
    try:
        return _drain(primary, tiers, names, cascades, poll, seconds, clock)
    except Exception:
        logger.exception("shutdown: the drain failed; stopping without it")
        return None


def _drain(
    primary: CPUPrimaryTierOffloadingManager,
    tiers: Sequence[SecondaryTierManager],
    names: Sequence[str],
    cascades: Cascades,
    poll: Callable[[], None],
    seconds: float,
    clock: Callable[[], float],
) -> DrainReport | None:
    lasting = [idx for idx, tier in enumerate(tiers) if getattr(tier, "lasting", True)]
    if seconds <= 0 or not lasting:
        return None
    start = clock()
    deadline = start + seconds
    poll()
    candidates = _held_only_by_primary(primary, [tiers[idx] for idx in lasting])
    given = _assign(candidates, [(idx, tiers[idx]) for idx in lasting])
    waves = {idx: deque(keys) for idx, keys in given.items()}
    while True:
        for idx, queue in waves.items():
            if queue and not cascades.admission[idx].rows_in_flight:
                wave_size = cascades.admission[idx].max_rows
                wave = [queue.popleft() for _ in range(min(wave_size, len(queue)))]
                cascades.write(idx, [key for key in wave if primary.ref_count(key) == 0])
                guarded(tiers[idx], "on_schedule_end", None)  # a tier starts a step's jobs there
        busy = [idx for idx in range(len(tiers)) if cascades.admission[idx].rows_in_flight]
        if (not busy and not any(waves.values())) or clock() >= deadline:
            break
        waited = False
        for idx in busy:  # a tier's `drain` returns once its jobs are over (or at the deadline)
            if overrides(tiers[idx], "drain"):
                waited |= guarded(tiers[idx], "drain", False, max(0.0, deadline - clock()))
        if not waited:
            time.sleep(min(_POLL_S, max(0.0, deadline - clock())))
        poll()
    report = DrainReport(len(candidates), sum(map(len, given.values())), seconds=clock() - start)
    for idx, keys in given.items():
        report.written[names[idx]] = sum(_holds(tiers[idx], key) for key in keys)
    logger.info(
        "shutdown: wrote %s of the %d blocks only the CPU tier held in %.1f s; %d stay only there and end with it "
        "(%d beyond the lasting tiers' room, %d not written within shutdown_drain_s: %.1f s); a restart computes "
        "them again",
        ", ".join(f"{count} to {name}" for name, count in report.written.items()) or "none",
        report.candidates,
        report.seconds,
        report.left,
        report.no_room,
        report.left - report.no_room,
        seconds,
    )
    return report


def _held_only_by_primary(
    primary: CPUPrimaryTierOffloadingManager, lasting: list[SecondaryTierManager]
) -> list[OffloadKey]:
    """The primary tier's idle blocks (no cascade reading them, none being written) that no
    lasting tier answers True for, hottest first."""
    ref_count = primary.ref_count
    hottest = reversed(primary.coldest(primary.num_blocks))
    return [key for key in hottest if ref_count(key) == 0 and not any(_holds(tier, key) for tier in lasting)]


def _holds(tier: SecondaryTierManager, key: OffloadKey) -> bool:
    try:
        return tier.lookup(key, BACKGROUND) is True
    except Exception:
        return False


def _assign(
    candidates: list[OffloadKey], lasting: list[tuple[int, SecondaryTierManager]]
) -> dict[int, list[OffloadKey]]:
    """The candidates, in order, to the lasting tiers: as many as each holds, then the next."""
    given: dict[int, list[OffloadKey]] = {}
    rest = candidates
    for idx, tier in lasting:
        if not rest:
            break
        room = guarded(tier, "capacity_blocks", None, rest[0])
        taken = rest if room is None else rest[:room]
        given[idx], rest = taken, rest[len(taken) :]
    return given
