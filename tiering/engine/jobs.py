"""The engine's records of its work: jobs in flight and their deadlines, how finished ones
are heard of, promotions queued in the step and the rows they may hold.

Thread: the scheduler thread only (plain data, owned by `TieringOffloadingManager`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tiering.contract.keys import OffloadKey, ReqContext
from tiering.tiers.base import Doorbell, SecondaryTierManager


@dataclass
class Job:
    """A job submitted to a secondary tier and not reported yet (or held past its report)."""

    keys: list[OffloadKey]
    rows: list[int]  # the primary rows its I/O reads (a cascade) or writes (a promotion)
    is_promotion: bool
    req_context: ReqContext
    tier_idx: int
    queued_at: float = 0.0  # a promotion's first lookup, perf_counter seconds (unused for cascades)
    due: float = float("inf")  # the job fails here after this (`Deadlines.clock` seconds)
    voided: bool = False  # by reset_cache: its keys are gone and its rows held until it ends


Polled = tuple[int, SecondaryTierManager, bool]  # (tier index, tier, has `take_released_jobs`)


@dataclass
class Polling:
    """How the manager hears of finished jobs: the tiers that ring `doorbell` are polled
    after a ring (`ringing`), the others every step (`every_step`)."""

    doorbell: Doorbell
    ringing: list[Polled]
    every_step: list[Polled]


JOB_DEADLINE_S = 120.0
"""Seconds a secondary tier has to report a job before the manager fails it (four of a block
store's ``op_timeout_s``: a tier whose calls time out reports long before)."""


@dataclass
class Deadlines:
    """When unreported jobs fail: `seconds` after submission on `clock`; `unresponsive`: the
    tiers with a job failed so, not promoted from until they report again."""

    seconds: float | None
    clock: Callable[[], float]
    unresponsive: set[int] = field(default_factory=set)


@dataclass
class PromotionRows:
    """The CPU rows promotions may hold: `held` now (queued or in flight), at most
    `max_rows`, and only while more than `store_reserve` rows stay available to the GPU's
    stores; one promotion is always let through when none holds a row."""

    max_rows: int
    store_reserve: int
    held: int = 0

    def allow(self, available: int) -> bool:
        """Whether one more promotion may take a row, `available` rows being free or idle."""
        return not self.held or (self.held < self.max_rows and available > self.store_reserve)


@dataclass
class PendingLoads:
    """Promotions a load may pin before they land: those of the tiers that settle their
    rows' states (`settling_tiers`), by key (`keys`: key -> tier index), queued or in
    flight; `answer_hits`: lookups answer True for them."""

    settling_tiers: set[int]
    answer_hits: bool = False
    keys: dict[OffloadKey, int] = field(default_factory=dict)


@dataclass
class QueuedPromotion:
    """A request's blocks queued for promotion from one tier in this step, and their rows."""

    req_context: ReqContext
    keys: list[OffloadKey] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    queued_at: float = field(default_factory=time.perf_counter)
