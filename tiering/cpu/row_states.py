"""`RowStates`: whether each CPU row's promotion has landed, shared by every process.

A lookup under the engine's own vLLM connector may answer "hit" for a block whose promotion
from a secondary tier is still running, so that the request loads it in the step it was
found (`tiering.integrations.vllm_connector`). The worker's copy of that row must then wait
for the tier's read, and must never copy it if the read failed. One byte per row says which:

- ``READY`` (0): the row's bytes are whatever its block says (the state of every row that
  no promotion is filling: rows stored from the GPU, free rows);
- ``PENDING``: a promotion is filling the row;
- ``FAILED``: that promotion failed (the read, its check, or the tier): the row holds no
  block, and a load that waited for it loads nothing from it. A worker whose GPU store into
  a row failed (its copy raised) marks it so too (`fail_store`), and counts the rows in its
  own slot of a shared counter: the scheduler, which completes the store when vLLM tells it
  to, looks at the rows of a completed store only while that count is ahead of what it has
  handled (`store_failures`), and keeps none of them.

Who writes, in order: the scheduler thread marks a row ``PENDING`` when it reserves it for a
promotion (`mark`), and ``READY`` when it reserves it for anything else; the tier marks it
``READY`` or ``FAILED`` as soon as the block's bytes are checked, from whatever thread
finishes its read (`settle`); the scheduler settles it again when it processes the job (a
tier that settles nothing, or that failed the job before reading). A worker only reads
(`wait_any`). A row is pinned while a load waits on it, so its state changes once during the
wait, from ``PENDING`` to its end.

The bytes live after the rows in the engine's `SharedOffloadRegion`; a byte store is
atomic, and on x86 a store of the state is seen after the stores of the row's bytes before
it. (Python offers no fence: on weaker memory models the wait's re-check of the state is
what stands between a worker and a torn row.)

Thread: any; see the protocol above for who may write what when.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

PROMOTION_WAIT_S = 1.0
"""How long a worker's load waits for a row whose promotion is still landing, seconds from
the load's submission: it holds up a serving step, so a promotion slower than this becomes a
recompute of its blocks. The loads a step submits together share the deadline, so the step's
forward waits at most this long, not this long per load (one thread copies them in turn).
A lookup answers no early hit for a promotion pending longer than this (it would only make
the next step wait for it too): the request recomputes those blocks."""

READY, PENDING, FAILED = 0, 1, 2

_FIRST_NAP_S = 20e-6  # a worker's first nap while waiting; doubled up to `_LONGEST_NAP_S`
_LONGEST_NAP_S = 1e-3


class RowStates:
    """One state byte per CPU row (see the module docstring).

    Args:
        states: a uint8 array of one byte per row, in memory every process maps (or a
            private array for a single process).
        store_failures: a uint64 array, one slot per worker rank, in the same memory: the
            rows each rank's failed stores marked; None: a private one-slot array.
        rank: the slot this process counts into (a worker's rank; 0 elsewhere).
    """

    def __init__(self, states: np.ndarray, store_failures: np.ndarray | None = None, rank: int = 0):
        if states.dtype != np.uint8 or states.ndim != 1:
            raise ValueError(f"row states must be a 1-D uint8 array, got {states.dtype} of shape {states.shape}")
        self.states = states
        self._store_failures = np.zeros(1, dtype=np.uint64) if store_failures is None else store_failures
        self._rank = rank
        self._handled = 0  # rows of failed stores the scheduler has dealt with (its instance only)

    def __len__(self) -> int:
        """Rows, one state byte each."""
        return len(self.states)

    def mark(self, rows: Sequence[int] | np.ndarray, state: int) -> None:
        """Set `rows` to `state` (scheduler thread, when it reserves them)."""
        self.states[np.asarray(rows, dtype=np.int64)] = state

    def fail_store(self, rows: np.ndarray) -> None:
        """Mark the rows of a GPU store whose copy failed ``FAILED``, then count them
        (worker thread: the count is seen after the marks)."""
        self.states[rows] = FAILED
        self._store_failures[self._rank] += np.uint64(len(rows))

    def store_failures_pending(self) -> bool:
        """Whether rows that failed stores marked (`fail_store`, any worker) are more than
        this instance has handled (`handle_store_failures`). Scheduler thread; cheap."""
        return sum(self._store_failures.tolist()) != self._handled

    def handle_store_failures(self, rows: int | None) -> None:
        """Count `rows` marked by failed stores as dealt with; None: all marked so far (a
        reset forgets every block). Scheduler thread."""
        self._handled = sum(self._store_failures.tolist()) if rows is None else self._handled + rows

    def settle(self, row: int, ok: bool) -> None:
        """End row `row`'s promotion: ``READY`` if its bytes are in and checked, else
        ``FAILED``. Any thread; idempotent for the same outcome."""
        self.states[row] = READY if ok else FAILED

    def wait_any(self, rows: np.ndarray, deadline: float) -> np.ndarray:
        """Block until a row of `rows` (int64 ids) is not ``PENDING``, or until `deadline`
        (a `time.monotonic` value), whichever comes first (worker thread).

        Returns:
            The states of `rows` when it stopped waiting, in the order of `rows` (a copy).
        """
        nap = _FIRST_NAP_S
        while True:
            current = self.states[rows]
            if (current != PENDING).any() or time.monotonic() >= deadline:
                return current
            time.sleep(nap)
            nap = min(2 * nap, _LONGEST_NAP_S)
