"""`ExistenceChecks`: what a block-store tier that `probe_misses` knows of keys it does not
index: a check in flight, or an absence believed until a time.

A lookup of a key the index lacks asks the store whether it exists (another engine may have
written it to a shared directory, bucket or Valkey); the lookup answers None until the store
answers. A found key joins the index; an absent one is believed absent for `negative_ttl_s`.
At most `MAX_ANSWERS` answers and checks are remembered; past it the oldest is forgotten in
O(1) (an absence expired by then, or the earliest to expire: its key is checked again at its
next miss; an answer for a forgotten check is dropped).

Thread: the scheduler thread only (the tier sends the checks; its loop answers through the
outbox).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection

from tiering.contract.keys import OffloadKey

MAX_ANSWERS = 65536
"""Checks in flight and absences remembered at most."""


class ExistenceChecks:
    """Keys whose existence was asked of the store (None: in flight) or found absent (until
    when, on `clock`), oldest first; and the keys to ask about at the end of the step.

    Args:
        negative_ttl_s: how long an absence is believed, seconds.
        clock: seconds, monotonic.
    """

    def __init__(self, negative_ttl_s: float, clock: Callable[[], float]):
        self.negative_ttl_s = negative_ttl_s
        self._clock = clock
        self._answers: OrderedDict[OffloadKey, float | None] = OrderedDict()
        self._pending: list[OffloadKey] = []  # to ask about at the end of the step

    def __len__(self) -> int:
        """Checks in flight and absences remembered."""
        return len(self._answers)

    def lookup(self, key: OffloadKey) -> bool | None:
        """False while `key` is believed absent; else None: a check is in flight, or one is
        started now (sent by `take_pending`)."""
        state = self._answers.get(key, 0.0)
        if state is None:
            return None
        if state > self._clock():
            return False
        self._remember(key, None)
        self._pending.append(key)
        return None

    def absent(self, key: OffloadKey) -> None:
        """Believe `key` absent for `negative_ttl_s` (a forged object was dropped: not found
        again at once)."""
        self._remember(key, self._clock() + self.negative_ttl_s)

    def forget(self, keys: Collection[OffloadKey]) -> None:
        """`keys` are being stored: what a check said of them is moot."""
        if self._answers:
            for key in keys:
                self._answers.pop(key, None)

    def take_pending(self) -> list[OffloadKey]:
        """The keys to ask the store about (each once), and none any more."""
        pending, self._pending = self._pending, []
        return pending

    def answered(self, keys: Collection[OffloadKey], found: Collection[OffloadKey]) -> list[OffloadKey]:
        """The store answered a check of `keys`: those in `found` exist. Returns the found
        keys whose check is still wanted (not stored or forgotten meanwhile): the tier
        indexes them."""
        absent_until = self._clock() + self.negative_ttl_s
        new = []
        for key in keys:
            if self._answers.get(key, 0.0) is not None:
                continue  # stored meanwhile, or the answer is moot
            if key not in found:
                self._remember(key, absent_until)
                continue
            del self._answers[key]
            new.append(key)
        return new

    def _remember(self, key: OffloadKey, state: float | None) -> None:
        answers = self._answers
        answers[key] = state
        answers.move_to_end(key)
        if len(answers) > MAX_ANSWERS:
            answers.popitem(last=False)
