"""The one hand-off between a block-store tier's two threads, and what crosses it.

An outcome is made on the scheduler thread, filled in on the loop thread while its task
runs, then put in the `Outbox`; from then on only the scheduler thread reads it. Nothing
else is shared between the threads: failures travel inside outcomes, not in counters both
threads touch.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

from tiering.contract.keys import OffloadKey
from tiering.errors import (
    CorruptObjectError,
    ForgedObjectError,
    HungCallError,
    ObjectNotFoundError,
    UnusableObjectError,
    is_no_space,
)
from tiering.tiers.base import Doorbell

FAILURE_REASONS = (
    "store",
    "store_no_space",
    "load",
    "load_missing",
    "load_corrupt",
    "load_unusable",
    "load_forged",
    "probe",
    "ping",
    "delete",
    "recover",
    "start",
    "internal",
)
"""Why a store call failed, as `Outcome.failed` records it and the tier counts it
(``failures`` by reason, every reason from the start at zero)."""


@dataclass(kw_only=True)
class Outcome:
    """What some store calls found. `failures`: (reason, error) of every failed call, for
    the tier's counters and log; `errors`: how many of them say the backend is sick (the
    health breaker counts those); `at`: when it was handed over (`Outbox.put`), perf_counter
    seconds; `epoch`: the tier's generation count when it was submitted (an outcome of an
    earlier one leaves the tier's index alone)."""

    failures: list[tuple[str, BaseException]] = field(default_factory=list)
    errors: int = 0
    at: float = 0.0
    epoch: int = 0

    def failed(self, reason: str, error: BaseException, sick: bool = True) -> None:
        """Record a failed call (loop thread); `reason` is one of `FAILURE_REASONS`."""
        self.failures.append((reason, error))
        self.errors += sick


@dataclass(kw_only=True)
class JobDone(Outcome):
    """A store or load job. It succeeds only if it was `complete` (no block refused before
    any I/O, nothing broke) and every key is in `ok`.

    `hung` (loop thread only) counts calls that timed out and have not returned; a job
    reported with some is reported with `rows_in_use`, and a `RowsReleased` follows when
    the last of them returns.
    """

    job_id: int
    keys: list[OffloadKey] = field(default_factory=list)
    ok: set[OffloadKey] = field(default_factory=set)
    complete: bool = True
    hung: int = 0
    rows_in_use: bool = False
    reported: bool = False

    @property
    def success(self) -> bool:
        return self.complete and len(self.ok) == len(self.keys)


@dataclass(kw_only=True)
class StoreDone(JobDone):
    """A store (cascade) job; `no_space`: blocks refused by a full device; `local`: blocks
    stored in this engine's own memory (`BlockStore.local_keys`), asked only where
    `wants_local` (the tier keeps KV events)."""

    no_space: int = 0
    wants_local: bool = False
    local: set[OffloadKey] = field(default_factory=set)

    def block_stored(self, key: OffloadKey, error: Exception | None) -> bool:
        """Record how `key`'s put ended (loop thread): stored, refused for lack of room (no
        sign of a sick backend), or failed. Returns whether it was stored."""
        if error is None:
            self.ok.add(key)
            return True
        if is_no_space(error):
            self.failed("store_no_space", error, sick=False)
            self.no_space += 1
        else:
            self.failed("store", error)
        return False


@dataclass(kw_only=True)
class LoadDone(JobDone):
    """A load (promotion) job; `drop`: keys whose object is missing, corrupt, unusable or
    forged; `forged`: those whose seal did not open."""

    drop: set[OffloadKey] = field(default_factory=set)
    forged: set[OffloadKey] = field(default_factory=set)

    def block_failed(self, key: OffloadKey, error: Exception) -> bool:
        """Record why `key` did not load (loop thread): a missing or forged object is a miss,
        a corrupt or unusable one is dropped, neither a sign of a sick backend; any other
        error is one, and a hung call's block is dropped too. Returns whether the object is
        corrupt or unusable (to be deleted)."""
        if isinstance(error, ObjectNotFoundError | ForgedObjectError):  # a forged one may be another deployment's
            self.failed("load_missing" if isinstance(error, ObjectNotFoundError) else "load_forged", error, sick=False)
            self.drop.add(key)
            if isinstance(error, ForgedObjectError):
                self.forged.add(key)
            return False
        if isinstance(error, CorruptObjectError):
            self.failed("load_unusable" if isinstance(error, UnusableObjectError) else "load_corrupt", error, False)
            self.drop.add(key)
            return True
        self.failed("load", error)
        if isinstance(error, HungCallError):  # dropped: a retry would strand another thread
            self.drop.add(key)
        return False


@dataclass(kw_only=True)
class ProbeDone(Outcome):
    """Existence checks of `keys`, the lookups of one step that missed the index; `found`:
    those that exist (a key whose check failed counts as absent)."""

    keys: list[OffloadKey]
    found: set[OffloadKey] = field(default_factory=set)


@dataclass(kw_only=True)
class RecoverDone(Outcome):
    """The recovery of what the store held (`BlockStore.recover`): `found`, (key, object
    bytes) oldest first, is set on the loop thread as soon as the listing ends, before the
    outcome is handed over (`tiering.tiers.blockstore.recovery`); empty if it failed."""

    found: list[tuple[OffloadKey, int]] | None = None


@dataclass(kw_only=True)
class PingDone(Outcome):
    """The health probe of an unhealthy tier; it worked if no call failed."""


@dataclass(kw_only=True)
class DeletesDone(Outcome):
    """Deletes of evicted or corrupt objects, done or failed: `keys`."""

    keys: list[OffloadKey] = field(default_factory=list)


@dataclass(kw_only=True)
class RowsReleased(Outcome):
    """The late calls of job `job_id`, reported with ``rows_in_use``, have all returned."""

    job_id: int


class Outbox:
    """Outcomes from the loop thread to the scheduler thread, and a count of the tasks
    started and finished, so the scheduler can tell (or wait until) nothing is in flight.
    `doorbell` is rung on every outcome handed over (the tier attaches the manager's)."""

    def __init__(self) -> None:
        self.doorbell = Doorbell()
        self._items: deque[Outcome] = deque()
        self._done = threading.Condition()
        self._started = 0
        self._finished = 0

    def task_started(self) -> None:
        """Scheduler thread: a task was handed to the loop."""
        self._started += 1

    def put(self, outcome: Outcome | None, task_finished: bool = True) -> None:
        """Any thread: hand `outcome` over (None: nothing to say); count a finished task."""
        with self._done:
            if outcome is not None:
                outcome.at = time.perf_counter()
                self._items.append(outcome)
                self.doorbell.ring()
            self._finished += task_finished
            self._done.notify_all()

    def take(self) -> list[Outcome]:
        """Scheduler thread: every outcome handed over so far, oldest first; never blocks."""
        items = self._items
        taken = []
        while items:
            taken.append(items.popleft())
        return taken

    def pending(self) -> bool:
        """A task is in flight, or an outcome waits to be taken."""
        return self._finished != self._started or bool(self._items)

    def idle(self) -> bool:
        """Every task started has finished (outcomes may still wait). Any thread."""
        return self._finished == self._started

    def wait_idle(self, timeout_s: float | None) -> bool:
        """Block until every task started has finished (outcomes may still wait), at most
        `timeout_s` seconds (None: no limit); True if so. Never from the loop thread."""
        with self._done:
            return self._done.wait_for(self.idle, timeout_s)
