"""`RequestAccesses`: what each request did to the primary tier, applied to the eviction
policy once, when the request finishes (as vLLM's own CPU manager does).

A request's blocks reach the primary tier through several calls, in whatever order and
container the scheduler uses (vLLM completes stores with a `set`). Ranking blocks as those
calls arrive would make the eviction order depend on Python's hash seed, and would often
evict a prefix's head first, which makes the rest of the prefix useless (a hit needs the
whole leading run). So each request's accesses are recorded here:

- ``keys``: the blocks it loaded (``prepare_load``) or offered for storage
  (``prepare_store``, and the primary side of a promotion it started) that were new or
  ready, in first-seen order;
- ``inserted``: those whose rows it reserved; ``reused``: the ready ones it loaded or
  offered again without having inserted them (a reuse, for ARC's frequency);
- ``store_missed``: the keys it already reported to the policy's `on_store_miss`, so
  a ghost hit adapts ARC once per request.

At ``on_request_finished`` the keys are put in prefix order (by the positions a vLLM
``ReqContext`` records, else first seen) and handed to the policy, which
ranks the head most recent. Reads by secondary tiers (cascades) are not accesses.

Thread: the scheduler thread only.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from typing import Any, TypeVar

from tiering.contract.keys import OffloadKey, get_offload_group_idx

_T = TypeVar("_T")


def per_request(requests: dict[str, _T], req_id: str, new: Callable[[], _T], max_requests: int) -> _T:
    """``requests[req_id]``, made with `new` if missing; the oldest request is forgotten
    when more than `max_requests` would be remembered."""
    entry = requests.get(req_id)
    if entry is None:
        entry = requests[req_id] = new()
        if len(requests) > max_requests:
            del requests[next(iter(requests))]
    return entry


class RequestAccess:
    """One request's accesses (see the module docstring)."""

    __slots__ = ("inserted", "keys", "reused", "store_missed")

    def __init__(self) -> None:
        self.keys: dict[OffloadKey, None] = {}
        self.inserted: set[OffloadKey] = set()
        self.reused: set[OffloadKey] = set()
        self.store_missed: set[OffloadKey] = set()

    def observe(self, keys: Iterable[OffloadKey], ready: Collection[OffloadKey]) -> None:
        """Record `keys` as seen and the `ready` ones among them as reused, unless this
        request inserted them."""
        self.keys.update(dict.fromkeys(keys))
        if ready:
            inserted = self.inserted
            self.reused.update(set(ready).difference(inserted) if inserted else ready)

    def prefix_order(self, req_context: Any) -> list[OffloadKey]:
        """The keys head to tail: by the request's recorded token positions when it has
        them for every key (vLLM's ``get_offload_key_position``; a tie, across KV groups,
        keeps the lower group first, as vLLM orders them), else in the order first seen (a
        scheduler offers a prefix head first)."""
        keys = list(self.keys)
        position = getattr(req_context, "get_offload_key_position", None)
        if position is not None:
            positions = {key: position(key) for key in keys}
            if None not in positions.values():
                keys.sort(key=lambda key: (positions[key], get_offload_group_idx(key)))
        return keys


class RequestAccesses:
    """The accesses of live requests, at most `max_requests` of them (the oldest is
    forgotten first: its accesses then never reach the policy)."""

    def __init__(self, max_requests: int = 4096):
        self._max_requests = max_requests
        self._requests: dict[str, RequestAccess] = {}

    def of(self, req_id: str) -> RequestAccess:
        """The accesses of `req_id` so far (made empty on first use)."""
        return per_request(self._requests, req_id, RequestAccess, self._max_requests)

    def finished(self, req_id: str) -> RequestAccess | None:
        """Forget `req_id` and return its accesses, or None if none were recorded."""
        return self._requests.pop(req_id, None)

    def clear(self) -> None:
        """Forget every request (a reset: accesses before it refer to blocks now gone)."""
        self._requests.clear()
