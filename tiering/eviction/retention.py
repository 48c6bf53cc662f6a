"""Soft retention of the CPU tier's blocks: what a client says it will need again.

A request may carry a hint in its ``kv_transfer_params`` (vLLM passes the OpenAI request's
``kv_transfer_params`` through), under the key ``kv_tiering``::

    {"kv_tiering": {"retain": "5m"}}     # or "1h", "24h", "P1D", 300 (seconds): tiering.options.parse_duration
    {"kv_tiering": {"release": true}}    # the session is over

*retain*: when the request finishes, the blocks it stored or loaded get a deadline, now plus
the duration; a later hint only extends a deadline. *release*: its blocks lose their
deadlines, and those it stored itself (not those it found already there: another request
had them, a shared document say) are evicted first, before any other block, unless a later
request uses them again. A hint that does not parse is ignored (logged rarely, with a count: `tiering.stats.RareLog`): a
client's mistake never fails its request nor floods the log.

Retention is soft: a block under a deadline waits outside its policy's eviction order
(`Reorder.park`: the LRU, ARC and ARC-S policies and a tier's index do), so no eviction walk
steps over it and no call pays for the blocks clients retain, and comes back when its
deadline passes, is given up or released (`Reorder.unpark`): at the least recent end if
eviction would have reached it by then without a deadline (every key ahead of it when it
was parked has left since; a release), else at the most recent end (a request used it
meanwhile, or it would still be in the tier). An order that keeps retained blocks in
place (a third party's policy, by default) has eviction pass over them: each moves to the
most recent end (`Reorder.defer`), out of the next walks' way, and back to the least recent
end (`Reorder.demote`) when its deadline passes, unless a request used it meanwhile, so it
costs a walk one step per pass of the whole order. If blocks without a deadline cannot go,
the retained blocks with the earliest deadlines lose them first. At most ``max_blocks``
(``retention_max_fraction`` of the tier) hold a deadline at once: past that, the earliest
deadline is dropped. A deadline that passed is forgotten, and the block is whatever its
ordinary recency makes it. So a client that retains everything for a day costs at most the
share of the tier the cap allows, never the tier.

Thread: the scheduler thread (the CPU tier's).
"""

from __future__ import annotations

import heapq
import logging
import reprlib
import time
from collections.abc import Callable, Collection, Container, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from tiering.contract.keys import OffloadKey
from tiering.eviction.base import BlockStatus, CachePolicy
from tiering.options import parse_duration
from tiering.stats import RareLog

logger = logging.getLogger(__name__)

HINT_KEY = "kv_tiering"
"""The key of the engine's hints in a request's ``kv_transfer_params``."""
RETENTION_MAX_FRACTION = 0.2
"""The default share of the CPU tier's rows that retention deadlines may hold at once: on the
Mooncake conversation trace a client that retains every request for a day then costs ARC-S at
most a point at 1-2% (2.3-2.9 with 0.5), while continuation hints gain as much as with 0.5."""
MAX_RETAIN_S = 7 * 86400.0
"""The longest retention a hint may ask for, seconds (a longer one is cut to it)."""


class Reorder(Protocol):
    """The order retained keys are moved in: a `CachePolicy`, or a tier's `BlockIndex`."""

    def park(self, key: OffloadKey) -> None:
        """Take resident `key` out of the eviction order while it holds a deadline (or keep
        it in place: eviction then passes it over, `defer`)."""

    def unpark(self, key: OffloadKey, recent: bool) -> None:
        """Put parked `key` back: at the most recent end if `recent`, else the least recent."""

    def __len__(self) -> int:
        """Keys held, parked ones included."""

    def defer(self, key: OffloadKey) -> None:
        """Move resident `key` to the most recent end of its order, counting no use."""

    def demote(self, key: OffloadKey) -> None:
        """Move resident `key` to the least recent end of its order, counting no use."""


@dataclass(frozen=True)
class RetentionHint:
    """What a request asked: `retain_s` seconds of retention (None: none), or `release`."""

    retain_s: float | None = None
    release: bool = False


def retention_s(value: Any) -> float:
    """Seconds of a hint's duration (`tiering.options.parse_duration`: ``"5m"``, ``"1h"``,
    ``"P1D"``, 300, ...), cut to `MAX_RETAIN_S`.

    Raises:
        ValueError: not a positive duration, or text of more than
            `tiering.options.MAX_DURATION_CHARS` characters (the message shows at most ~40 characters of it).
    """
    return min(parse_duration(value), MAX_RETAIN_S)


def hint_of(req_context: Any, log: RareLog | None = None) -> RetentionHint | None:
    """The request's hint (see the module docstring), or None when it gave none or one that
    does not parse (counted and logged by `log`, rarely: a client's mistakes never flood the
    log; None: not logged). Never raises."""
    params = getattr(req_context, "kv_transfer_params", None)
    if not isinstance(params, dict) or HINT_KEY not in params:
        return None
    hint = params[HINT_KEY]
    try:
        if not isinstance(hint, dict) or len(hint) > 2 or not set(hint) <= {"retain", "release"}:
            raise ValueError(f"expected {{'retain': duration}} or {{'release': true}}, got {reprlib.repr(hint)}")
        retain = hint.get("retain")
        return RetentionHint(None if retain is None else retention_s(retain), hint.get("release") is True)
    except (ValueError, OverflowError) as exc:  # a JSON number too large for a float overflows
        if log is not None:
            log.warning(
                logger, "request %.64s: hint %s ignored: %s", getattr(req_context, "req_id", "?"), HINT_KEY, exc
            )
        return None


def new_counters() -> dict[str, int]:
    """The counters of a `Retention`, at zero (several may share one dict: a tier's tenants)."""
    return {"retentions": 0, "retentions_expired": 0, "retentions_released": 0, "retentions_dropped": 0}


class Retention:
    """The deadlines and releases of one tier's blocks, or of one tenant's in the CPU tier
    (see the module docstring).

    Args:
        max_blocks: blocks that may hold a deadline at once (>= 1).
        order: what ranks the keys for eviction (`pass_over` and lapsed deadlines move them in
            it); an attribute of the same name may be replaced later (a tier reset).
        clock: seconds, monotonic (tests move their own; the load generator follows its
            trace's clock); an attribute of the same name may be replaced later.
        counters: the dict to count in (`new_counters`), shared with other retentions; None:
            one of its own.
    """

    def __init__(
        self,
        max_blocks: int,
        order: Reorder,
        clock: Callable[[], float] = time.monotonic,
        counters: dict[str, int] | None = None,
    ):
        self.max_blocks = max(1, max_blocks)
        self.order = order
        self.clock = clock
        self._deadlines: dict[OffloadKey, float] = {}
        self._heap: list[tuple[float, OffloadKey]] = []  # (deadline, key); stale entries skipped
        self._released: dict[OffloadKey, None] = {}  # evicted first, oldest release first
        self._shared: set[OffloadKey] = set()  # found stored by another request: never released
        self._passed: set[OffloadKey] = set()  # deferred by `pass_over`, unused since: demoted at their lapse
        self._used: set[OffloadKey] = set()  # holding a deadline, used since it began: back most recent
        self._due: dict[OffloadKey, int] = {}  # parked: the departures after which eviction would have reached it
        self._departed = 0  # keys that left the order (`evicted`, `forget`)
        self.counters = new_counters() if counters is None else counters

    def __len__(self) -> int:
        """Blocks holding a deadline (some may have passed since the last `live`)."""
        return len(self._deadlines)

    def retain(self, keys: Collection[OffloadKey], seconds: float) -> None:
        """Give `keys` a deadline `seconds` from now, or keep a later one; past `max_blocks`,
        the earliest deadlines are dropped (counted in ``retentions_dropped``)."""
        self.used(keys)
        deadline = self.clock() + seconds
        deadlines, heap, park = self._deadlines, self._heap, self.order.park
        parked = []
        for key in keys:
            if deadlines.get(key, -1.0) < deadline:
                if key not in deadlines:
                    park(key)
                    parked.append(key)
                deadlines[key] = deadline
                heapq.heappush(heap, (deadline, key))
        self.counters["retentions"] += len(parked)
        ahead = self._departed + max(0, len(self.order) - len(deadlines))  # the keys eviction takes first
        self._due.update(dict.fromkeys(parked, ahead))
        lapsed: list[tuple[OffloadKey, bool]] = []
        while len(deadlines) > self.max_blocks:
            self._pop_earliest("retentions_dropped", lapsed)
        self._demote(lapsed)
        if len(heap) > 2 * len(deadlines) + 64:  # mostly entries of deadlines extended since: rebuild
            self._heap = [(when, key) for key, when in deadlines.items()]
            heapq.heapify(self._heap)

    def release(self, keys: Iterable[OffloadKey]) -> None:
        """`keys` lose their deadlines and go first at the next evictions (a session the
        client closed), until evicted (`forget`) or used again (`used`); a key another
        request has used since it was stored (`shared`) is left alone."""
        for key in keys:
            if key in self._shared:
                continue
            if self._deadlines.pop(key, None) is not None:
                self._used.discard(key)
                self._due.pop(key, None)
                self.order.unpark(key, False)  # into the order again, the least recent: it goes first
            self._passed.discard(key)
            self._released[key] = None
            self.counters["retentions_released"] += 1

    def shared(self, keys: Collection[OffloadKey]) -> None:
        """A request found `keys` stored by another (a system prompt, a shared document):
        they are no longer one request's to release, until they leave the tier (`forget`)."""
        self._shared.update(keys)
        self.used(keys)

    def used(self, keys: Collection[OffloadKey]) -> None:
        """A request used `keys`: those released are not evicted first any more, and those
        passed over now hold the place the use gave them."""
        if self._released:
            for key in keys:
                self._released.pop(key, None)
        if self._passed:
            self._passed.difference_update(keys)
        if self._deadlines:
            deadlines = self._deadlines
            self._used.update(key for key in keys if key in deadlines)

    def pass_over(self, keys: list[OffloadKey]) -> None:
        """An eviction walk stepped over `keys` for their live deadlines: each moves to the
        most recent end of the order (`Reorder.defer`), so later walks reach it only after
        every other key, and back to the least recent end when its deadline lapses."""
        defer = self.order.defer
        for key in keys:
            defer(key)
        self._passed.update(keys)

    def released(self, n: int, evictable: Callable[[OffloadKey], bool]) -> list[OffloadKey]:
        """Up to `n` released keys that are `evictable` now, oldest release first; they stay
        released until `forget` (their eviction) or `used`."""
        taken: list[OffloadKey] = []
        for key in self._released:
            if len(taken) == n:
                break
            if evictable(key):
                taken.append(key)
        return taken

    @property
    def active(self) -> bool:
        """Whether some key holds a deadline or waits to be evicted first: eviction without
        either is the policy's alone."""
        return bool(self._deadlines or self._released)

    def is_released(self, key: OffloadKey) -> bool:
        """Whether `key` waits to be evicted first."""
        return key in self._released

    @property
    def has_released(self) -> bool:
        """Whether some key waits to be evicted first."""
        return bool(self._released)

    def forget(self, keys: Iterable[OffloadKey]) -> None:
        """`keys` left the tier (evicted, or dropped): their deadlines and releases go with
        them (not counted). The tier calls it for every key that leaves."""
        keys = keys if isinstance(keys, list | tuple) else list(keys)
        self._departed += len(keys)
        deadlines, released = self._deadlines, self._released
        for key in keys:
            deadlines.pop(key, None)
        if released:
            for key in keys:
                released.pop(key, None)
        if self._shared:
            self._shared.difference_update(keys)
        if self._passed:
            self._passed.difference_update(keys)
        if self._used:
            self._used.difference_update(keys)
        if self._due:
            for key in keys:
                self._due.pop(key, None)

    def evicted(self, keys: Collection[OffloadKey]) -> None:
        """`keys`, chosen by eviction without a live deadline (`retained_candidates`, or a
        tier index's own walk), were evicted: their releases and shares go with them."""
        self._departed += len(keys)
        if self._released:
            for key in keys:
                self._released.pop(key, None)
        if self._shared:
            self._shared.difference_update(keys)

    def clear(self) -> None:
        """Forget every deadline and release (a reset of the tier)."""
        self._deadlines.clear()
        self._heap.clear()
        self._released.clear()
        self._shared.clear()
        self._passed.clear()
        self._used.clear()
        self._due.clear()

    def live(self) -> Container[OffloadKey] | None:
        """The keys whose deadline has not passed (those that passed are forgotten, counted
        in ``retentions_expired``), or None if there are none: what eviction passes over."""
        now, heap = self.clock(), self._heap
        lapsed: list[tuple[OffloadKey, bool]] = []
        while heap and heap[0][0] <= now:
            self._pop_earliest("retentions_expired", lapsed)
        self._demote(lapsed)
        return self._deadlines or None

    def give_up(self, n: int, keep: Collection[OffloadKey] | Container[OffloadKey]) -> int:
        """Drop the deadlines of up to `n` retained keys not in `keep`, earliest first
        (counted in ``retentions_dropped``): eviction found too few blocks without one.
        Returns how many were dropped."""
        dropped, put_back = 0, []
        lapsed: list[tuple[OffloadKey, bool]] = []
        while dropped < n and self._heap:
            deadline, key = heapq.heappop(self._heap)
            if self._deadlines.get(key) != deadline:
                continue  # stale: extended, released or forgotten since
            if key in keep:
                put_back.append((deadline, key))
                continue
            self._lapse(key, "retentions_dropped", lapsed)
            dropped += 1
        for entry in put_back:
            heapq.heappush(self._heap, entry)
        self._demote(lapsed)
        return dropped

    def _pop_earliest(self, counter: str, lapsed: list[tuple[OffloadKey, bool]]) -> None:
        while self._heap:
            deadline, key = heapq.heappop(self._heap)
            if self._deadlines.get(key) == deadline:
                self._lapse(key, counter, lapsed)
                return

    def _lapse(self, key: OffloadKey, counter: str, lapsed: list[tuple[OffloadKey, bool]]) -> None:
        """`key`'s deadline is over (counted in `counter`): it joins `lapsed`, for `_demote`,
        with whether an eviction walk deferred it (and no request used it since)."""
        del self._deadlines[key]
        self.counters[counter] += 1
        passed = key in self._passed
        self._passed.discard(key)
        lapsed.append((key, passed))

    def _demote(self, lapsed: list[tuple[OffloadKey, bool]]) -> None:
        """Put the keys whose deadlines lapsed, earliest first, back in the order
        (`Reorder.unpark`): most recent if a request used them meanwhile or eviction would
        not have reached them yet (the keys ahead of them when parked have not all left),
        else least recent, the earliest deadline first; those an eviction walk deferred (an
        order that keeps retained keys in place) back where they were then."""
        order, used, due, departed = self.order, self._used, self._due, self._departed
        for key, passed in reversed(lapsed):
            recent = key in used or departed < due.pop(key, 0)
            used.discard(key)
            order.unpark(key, recent)
            if passed:
                order.demote(key)


class Either:
    """Keys in either of two containers (a reservation's keys and the blocks protected beside
    them, or those and the retained ones), without building their union."""

    __slots__ = ("first", "second")

    def __init__(self, first: Container[OffloadKey], second: Container[OffloadKey]):
        self.first, self.second = first, second

    def __contains__(self, key: object) -> bool:
        return key in self.first or key in self.second


def retained_candidates(
    policy: CachePolicy, retention: Retention | None, n: int, protected: Container[OffloadKey]
) -> list[Any]:
    """Up to `n` of `policy`'s idle blocks not in `protected`, as its tokens
    (`CachePolicy.candidates`), by the rules of the module docstring: released blocks first,
    then those without a live deadline in the policy's order, then, giving up the earliest
    deadlines, retained ones. Fewer than `n` if there are too few.

    Raises:
        NotImplementedError: the policy cannot list candidates.
    """
    if retention is None or not retention.active:
        return policy.candidates(n, protected)
    chosen: list[Any] = []
    if retention.has_released:

        def idle(key: OffloadKey) -> bool:
            token = policy.candidate(key)
            return token is not None and token[1].ref_cnt == 0 and key not in protected

        chosen = [policy.candidate(key) for key in retention.released(n, idle)]
    guard = Either(protected, {token[0] for token in chosen}) if chosen else protected
    rest, short = _unretained(policy, retention, n - len(chosen), guard)
    if short and retention.give_up(short, protected):
        rest, _ = _unretained(policy, retention, n - len(chosen), guard)
    return chosen + rest


def _unretained(
    policy: CachePolicy, retention: Retention, n: int, guard: Container[OffloadKey]
) -> tuple[list[Any], int]:
    """Up to `n` of `policy`'s candidates outside `guard` without a live deadline, and how
    many short of `n` they are while some deadline lives (0 when none does). Retained keys
    the walk meets are passed over (`Retention.pass_over`: out of the way) and the walk is
    taken again, twice as far each time, until it finds `n` others, runs out of keys or
    meets passed ones again."""
    live = retention.live()
    if live is None:
        return policy.candidates(n, guard), 0
    want, met = n, None
    while True:
        walked = policy.candidates(want, guard)
        passed = [token[0] for token in walked if token[0] in live]
        if not passed:
            return walked[:n], max(0, n - len(walked))
        free = [token for token in walked if token[0] not in live][:n]
        done = len(free) == n or len(walked) < want or (met is not None and met.issuperset(passed))
        retention.pass_over(passed)  # before returning too: they were walked
        if done:  # found them, ran out of keys, or came back round to those passed over
            return free, n - len(free)
        met = set(passed) if met is None else met | set(passed)
        want *= 2


def evict_retained(
    policy: CachePolicy, retention: Retention | None, chosen: list[Any]
) -> list[tuple[OffloadKey, BlockStatus]]:
    """Evict the tokens `retained_candidates` chose, and forget their deadlines and releases.
    A released block leaves the policy as dropped (`CachePolicy.remove`: no ARC ghost entry),
    the others as the policy evicts them: a release was the client's call, not the policy's,
    so its block coming back says nothing of the policy's balance.

    Returns:
        (key, block) of each, the released ones first.
    """
    if retention is None:
        return policy.evict_candidates(chosen)
    released = {token[0] for token in chosen if retention.is_released(token[0])} if retention.has_released else ()
    if released:
        evicted = [(token[0], token[1]) for token in chosen if token[0] in released]
        for key, _ in evicted:
            policy.remove(key)
        evicted += policy.evict_candidates([token for token in chosen if token[0] not in released])
    else:
        evicted = policy.evict_candidates(chosen)
    retention.evicted([key for key, _ in evicted])
    return evicted
