"""`RequestLookups`: blocks counted the way users reason about hit rates, once per request.

A scheduler asks about a request's blocks again and again: a lookup answered None (a
promotion or store in flight) is repeated next step, and some schedulers re-check a whole
prefix every step. Per-call counters (each tier's ``lookups``, ``hits``) count every one of
those calls. Here each (request, block) pair counts once:

- ``requested_blocks``: pairs the engine saw: looked up, or stored without a lookup (a
  scheduler stops looking up at a request's first miss and computes, then stores, the rest);
  ``requested_tokens`` is that times the tokens per block;
- ``lookups_repeated``: the further lookups of a pair already asked about;
- ``hit_blocks`` by tier: pairs whose lookup answered True at some point, counted once, for
  the tier that supplied the block: ``cpu`` if it was in the CPU tier when the request first
  asked, else the secondary tier it was promoted from (``cpu`` when it arrived from the GPU,
  stored by another request). ``hit_tokens`` likewise;
- ``hit_blocks_by_group``: the same hits by KV-cache group (the key's group index), so that a
  hybrid model's sliding-window and full-attention groups show their hits apart;
- ``hits_ended_by_group``: pairs whose first lookup answered a miss, by group. A scheduler
  stops scanning a group at its first miss, and under vLLM a request's hit is the shortest
  of its groups' (a group it does not reach is not asked), so each counts a hit ended by
  that group: a group that ends hits while the others hit is what holds a hybrid model's
  hits back (a sliding window stored too short), even where the engine serves no hit at all.

So ``sum(hit_tokens) / requested_tokens`` is the engine's token hit rate over the blocks it
was asked for: the GPU prefix cache in front is excluded (the scheduler never asks about
blocks it holds), and so is a prompt's last, partial block (never stored). Under vLLM a
request's full decode blocks are stored too, and count as requested. With several KV groups
each group's block counts, which leaves the ratio unchanged.

Thread: the scheduler thread only.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

from tiering.contract.keys import OffloadKey, get_offload_group_idx, make_offload_key
from tiering.cpu.request_access import per_request
from tiering.tiers.context import PRIMARY_NAME

_GROUP_0 = make_offload_key(b"", 0)  # the 4 bytes of group index 0 that end a key


class RequestLookups:
    """Per-request memory of which blocks were seen and which hit.

    A request is forgotten at `finished`; at most `max_requests` are remembered (the oldest
    is forgotten first), which bounds the memory of a scheduler that never reports finished
    requests: one dict entry per block a request asked about. A live request forgotten so
    counts its blocks again when it asks again.
    """

    def __init__(self, source: Callable[[OffloadKey], str | None], max_requests: int = 4096):
        """
        Args:
            source: the secondary tier a key was last promoted from, or None (see
                `TieringOffloadingManager.promotion_source`).
            max_requests: requests remembered at once (>= 1).
        """
        self._source = source
        self._max_requests = max_requests
        self._requests: dict[str, dict[OffloadKey, bool]] = {}  # req_id -> key -> hit counted
        self.requested_blocks = 0
        self.lookups_repeated = 0
        self.hit_blocks: Counter[str] = Counter()
        self._hits_past_group_0: Counter[int] = Counter()  # by group index; group 0's are the rest
        self._misses = 0  # first answers False
        self._misses_past_group_0: Counter[int] = Counter()  # by group index; group 0's are the rest

    def __len__(self) -> int:
        """Requests remembered: they looked up or stored a block, and are not finished."""
        return len(self._requests)

    def answered(self, req_id: str, key: OffloadKey, answer: bool | None, source: str | None = None) -> None:
        """Count the manager's answer (True, False, or None: ask again) to a lookup of `key`
        for request `req_id`; `source`: the tier a True answer's block is being promoted
        from (None: the CPU tier, or the tier it was promoted from). Never raises."""
        asked = self._requests.get(req_id) or self._request(req_id)
        hit = asked.get(key)
        if hit is None:
            self.requested_blocks += 1
            asked[key] = answer is True
            if answer is True:
                self.hit_blocks[source or PRIMARY_NAME] += 1
                if not key.endswith(_GROUP_0):
                    self._hits_past_group_0[get_offload_group_idx(key)] += 1
            elif answer is False:
                self._misses += 1
                if not key.endswith(_GROUP_0):
                    self._misses_past_group_0[get_offload_group_idx(key)] += 1
            return
        self.lookups_repeated += 1
        if answer is True and not hit:
            asked[key] = True
            self.hit_blocks[self._source(key) or PRIMARY_NAME] += 1
            if not key.endswith(_GROUP_0):
                self._hits_past_group_0[get_offload_group_idx(key)] += 1

    @property
    def hit_blocks_by_group(self) -> dict[int, int]:
        """``hit_blocks`` of every tier by KV-cache group index (groups with hits only)."""
        return _by_group(sum(self.hit_blocks.values()), self._hits_past_group_0)

    @property
    def hits_ended_by_group(self) -> dict[int, int]:
        """First lookups of a (request, block) answered a miss, by KV-cache group index
        (groups with misses only)."""
        return _by_group(self._misses, self._misses_past_group_0)

    def by_group(self) -> dict[str, dict[str, int]]:
        """``hit_blocks_by_group`` and ``hits_ended_by_group``, as `get_stats` counters
        (group indices as strings, in order)."""
        return {
            name: {str(group): count for group, count in sorted(by_group.items())}
            for name, by_group in (
                ("hit_blocks_by_group", self.hit_blocks_by_group),
                ("hits_ended_by_group", self.hits_ended_by_group),
            )
        }

    def stored(self, req_id: str, keys: Iterable[OffloadKey]) -> None:
        """Count the blocks of a store for request `req_id` it never looked up. Never raises."""
        asked = self._request(req_id)
        before = len(asked)
        if before:
            asked.update((key, False) for key in keys if key not in asked)
        else:  # no lookup yet: every key is new
            asked.update(dict.fromkeys(keys, False))
        self.requested_blocks += len(asked) - before

    def finished(self, req_id: str) -> dict[OffloadKey, bool]:
        """Forget the request (it will not be looked up again); returns its blocks, each
        with whether a lookup found it (False: a miss, or stored without a lookup), empty
        for an unknown request."""
        return self._requests.pop(req_id, None) or {}

    def _request(self, req_id: str) -> dict[OffloadKey, bool]:
        return per_request(self._requests, req_id, dict, self._max_requests)


def _by_group(total: int, past_group_0: Counter[int]) -> dict[int, int]:
    """`total` by group index, given the counts of the groups past 0 (groups counted only)."""
    first = total - sum(past_group_0.values())
    return {0: first, **past_group_0} if first else dict(past_group_0)
