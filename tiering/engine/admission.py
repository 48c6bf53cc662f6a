"""Admission in front of a secondary tier: which cascades it gets, and which it is spared.

Thread: the scheduler thread only (the manager calls every method).

A cascade pins its blocks' primary rows until the tier reports the job, so a tier slower
than the store rate would pin the whole primary tier and starve the GPU's stores. Each
secondary tier therefore has a `TierAdmission`, configured under the tier's ``admission``
key (`AdmissionConfig`):

- **A bound** on the rows its cascades pin at once (``max_rows_in_flight``, by default half
  the primary rows shared between the tiers): blocks beyond it wait, unpinned, and are
  cascaded as soon as the tier reports enough jobs (``cascades_deferred``); at most the
  bound's worth wait (older ones are dropped), and a block evicted from the primary tier
  before its turn is dropped (``cascades_dropped``). A cascade that finds nothing in flight
  always goes whole, so a job larger than the bound is never starved.
- **Adaptive shedding**: the tier's service rate is measured (bytes it finished per second
  of busy time, smoothed); a cascade is dropped when the bytes already in flight would take
  longer than ``max_backlog_s`` at that rate. A tier that keeps up never has such a backlog,
  so it drops nothing; before the first measurement only the bound applies.
- **A reuse filter** (``min_reuse``): only blocks stored at least N times (a count-min
  sketch of block keys, halved every ``reuse_window`` stores so old popularity fades) are
  cascaded; the others are ``cascades_filtered``.
- **Write-back** (``write: back``) instead of the default write-through: a block is not
  cascaded when it is stored but when it nears eviction from the primary tier: each step
  the manager copies the ``writeback_window`` coldest idle blocks (by default an eighth of
  the primary rows) that the tier does not hold yet. Blocks evicted before their turn are
  lost to this tier; blocks used while hot are never written.

- **Durable retention** (``retained_write_s``): a request that asks to retain its blocks at
  least this long (`tiering.eviction.retention`) has them written to the tier even where the reuse
  filter, shedding or write-back would skip them (``cascades_retained``): a client that
  says "1h" means it will come back after the CPU tier has turned over.

Dropped and filtered blocks stay in the primary tier; only the copy to this tier is skipped.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from tiering.contract.keys import OffloadKey
from tiering.eviction.sketch import CountMinSketch
from tiering.options import STRICT, Count, Seconds
from tiering.stats import ServiceRate

_SKETCH_WIDTH = 1 << 16


class AdmissionConfig(BaseModel):
    """The ``admission`` key of a secondary tier's config.

    Attributes:
        max_rows_in_flight: primary rows this tier's cascades may pin at once; None: half
            the primary rows divided by the number of secondary tiers.
        max_backlog_s: drop cascades while the bytes in flight would take longer than this
            at the tier's measured rate, seconds; None: no adaptive shedding.
        min_reuse: cascade only blocks stored at least this many times (1: every block; at
            most 255, where the sketch's counters saturate).
        reuse_window: stores after which the reuse counts are halved.
        write: ``through`` (cascade every stored block) or ``back`` (cascade blocks nearing
            eviction).
        writeback_window: with ``write: back``, how many of the coldest primary blocks are
            kept written; None: an eighth of the primary rows.
        retained_write_s: a request's retention hint of at least this many seconds writes
            its blocks to this tier whatever the rules above say (for a tier that keeps
            deadlines: a block-store tier); None: hints never bypass them.
    """

    model_config = ConfigDict(**STRICT, frozen=True)

    max_rows_in_flight: Count | None = None
    max_backlog_s: Seconds | None = 1.0
    min_reuse: Annotated[int, Field(ge=1, le=255)] = 1
    reuse_window: Count = 100_000
    write: Literal["through", "back"] = "through"
    writeback_window: Count | None = None
    retained_write_s: Seconds | None = 3600.0


class TierAdmission:
    """Decides, per cascade, which blocks a tier gets; tracks what it holds pinned.

    Attributes:
        write_back: whether the tier is written back (see `writeback_candidates`).
        counts_reuse: whether `stored` counts anything (a reuse filter, ``min_reuse`` > 1).
        rows_in_flight: primary rows pinned by this tier's unreported cascades.
        counters: ``cascades_admitted``, ``cascades_deferred`` (over the bound, made to
            wait), ``cascades_dropped`` (never copied: behind, or waited in vain),
            ``cascades_filtered`` (reuse), ``cascades_retained`` (written for a retention
            hint, past the rules), in blocks.
        waiting: blocks over the bound, oldest first, for `admit_waiting`.
    """

    def __init__(
        self,
        config: AdmissionConfig,
        primary_rows: int,
        tiers: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ):
        """
        Args:
            config: the tier's admission settings.
            primary_rows: rows of the primary tier (the defaults are fractions of it).
            tiers: secondary tiers sharing the primary rows.
            clock: seconds, monotonic (tests pass their own).
        """
        self.config = config
        self.max_rows = config.max_rows_in_flight or max(1, primary_rows // (2 * tiers))
        counted = ("admitted", "deferred", "dropped", "filtered", "retained")
        self.counters = {f"cascades_{name}": 0 for name in counted}
        self.waiting: dict[OffloadKey, None] = {}
        self._sketch = CountMinSketch(_SKETCH_WIDTH, config.reuse_window) if config.min_reuse > 1 else None
        self.counts_reuse = self._sketch is not None
        self.write_back = config.write == "back"
        self.writeback_window = config.writeback_window or max(1, primary_rows // 8)
        self._written: set[OffloadKey] = set()  # write-back: held by the tier (or being written)
        self._service = ServiceRate(clock)  # rows cascaded per busy second

    def stored(self, keys: Sequence[OffloadKey]) -> None:
        """The GPU stored `keys` in the primary tier (counted by the reuse filter)."""
        if self._sketch is not None:
            for key in keys:
                self._sketch.add(key)

    def writeback_candidates(
        self, coldest: Sequence[OffloadKey], idle: Callable[[OffloadKey], bool]
    ) -> list[OffloadKey]:
        """Of the primary tier's coldest blocks, those a write-back tier should copy now:
        idle, and not written yet (nor being written)."""
        written = self._written
        return [key for key in coldest if key not in written and idle(key)]

    def forget(self, is_resident: Callable[[OffloadKey], bool]) -> None:
        """Drop what is no longer in the primary tier from the written set (it may be
        stored again later), once the set has grown past twice the window."""
        if len(self._written) > 2 * self.writeback_window + self.max_rows:
            self._written = {key for key in self._written if is_resident(key)}

    def admit(self, keys: Sequence[OffloadKey]) -> list[OffloadKey]:
        """The leading blocks of a cascade of `keys` this tier takes now (they count as in
        flight until `finished`). Of the rest, those over the bound wait (a write-through
        tier's, see `admit_waiting`), the others are counted as dropped or filtered."""
        if self._sketch is None and not self._behind() and self._room(len(keys)) >= len(keys):
            return self._started(list(keys))  # every block, the rule while the tier keeps up
        wanted = list(keys)
        if self._sketch is not None:
            sketch, min_reuse = self._sketch, self.config.min_reuse
            wanted = [key for key in keys if sketch.count(key) >= min_reuse]
            self.counters["cascades_filtered"] += len(keys) - len(wanted)
        if self._behind():
            self.counters["cascades_dropped"] += len(wanted)
            return []
        admitted = wanted[: self._room(len(wanted))]
        over = wanted[len(admitted) :]
        if over and not self.write_back:  # a write-back tier is offered its blocks again anyway
            self._wait(over)
        else:
            self.counters["cascades_dropped"] += len(over)
        return self._started(admitted)

    def admit_waiting(self, usable: Callable[[OffloadKey], bool]) -> list[OffloadKey]:
        """The waiting blocks this tier takes now, oldest first, as `admit` would take
        them; those no longer `usable` (evicted from the primary tier, or being written
        again) are dropped, and all of them while the tier is behind."""
        waiting = self.waiting
        if self._behind():
            self.counters["cascades_dropped"] += len(waiting)
            waiting.clear()
            return []
        room = self._room(len(waiting))
        admitted: list[OffloadKey] = []
        while waiting and len(admitted) < room:
            key = next(iter(waiting))
            del waiting[key]
            if usable(key):
                admitted.append(key)
            else:
                self.counters["cascades_dropped"] += 1
        return self._started(admitted)

    def admit_retained(self, keys: Sequence[OffloadKey], seconds: float) -> list[OffloadKey]:
        """`keys`, which a request asked to retain `seconds` and the tier lacks, if that is at
        least ``retained_write_s`` (they count as in flight until `finished`), else none."""
        limit = self.config.retained_write_s
        if limit is None or seconds < limit or not keys:
            return []
        self.counters["cascades_retained"] += len(keys)
        return self._started(list(keys))

    def forced(self, keys: list[OffloadKey]) -> list[OffloadKey]:
        """`keys`, taken whatever the rules say (a stop's drain); in flight until `finished`."""
        return self._started(keys)

    def _room(self, wanted: int) -> int:
        return max(0, self.max_rows - self.rows_in_flight) if self.rows_in_flight else wanted

    def _wait(self, keys: list[OffloadKey]) -> None:
        waiting = self.waiting
        self.counters["cascades_deferred"] += len(keys)
        waiting.update(dict.fromkeys(keys))
        while len(waiting) > self.max_rows:
            del waiting[next(iter(waiting))]
            self.counters["cascades_dropped"] += 1

    def _started(self, admitted: list[OffloadKey]) -> list[OffloadKey]:
        self.counters["cascades_admitted"] += len(admitted)
        self._service.started(len(admitted))
        if self.write_back:
            self._written.update(admitted)
        return admitted

    def finished(self, keys: Sequence[OffloadKey], success: bool) -> None:
        """A cascade of `keys` was reported; their rows are no longer pinned. Its bytes
        count towards the measured rate only if it succeeded; a write-back tier tries the
        keys of a failed one again later."""
        self._service.finished(len(keys), done=success)
        if self.write_back and not success:
            self._written.difference_update(keys)

    @property
    def rows_in_flight(self) -> int:
        """Primary rows pinned by this tier's unreported cascades."""
        return self._service.in_flight

    @property
    def backlog_s(self) -> float | None:
        """Seconds the rows in flight would take at the measured rate (None: no rate yet)."""
        return self._service.seconds_for(self.rows_in_flight)

    def _behind(self) -> bool:
        limit, service = self.config.max_backlog_s, self._service  # (`backlog_s`, inline: once per cascade)
        return limit is not None and service.rate > 0 and service.in_flight / service.rate > limit
