"""How the fleet benchmark spreads requests over replicas (``tiering-bench serve --replicas N
--routing ...``):

- ``round-robin``: request i to replica i mod N, as a plain load balancer;
- ``session``: every turn of a conversation to one replica (conversations dealt out in
  turn as they start), the affinity a gateway gives;
- ``kv-events``: to the replica holding the longest cached prefix of the prompt, by the KV
  events every replica publishes (`KvEventsIndex`); ties to the replica with fewer requests
  in flight, then to the one sent fewer;
- ``kv-shared``: as ``kv-events``, but a block some replica announced in the shared tier
  counts for every replica (it is one load away from each: llm-d's pool pseudo-pod,
  llm-d-router #2586), at the weight of remote storage, and each request in flight on a
  replica takes `load_weight` blocks off its score, so a burst on one prefix spreads.

Only replicas in service are chosen: one leaves (`leave`: killed, or restarting) and joins
(`join`: started, or back) as the fleet's scenario says (`tiering.benchmarks.serve.scenarios`);
a conversation whose replica left moves to another.

A production router doing the same needs what this one is given: which of the KV events'
places are a tier every replica reads (here, every ``STORAGE`` place of the ``shared``
configuration: llm-d would mark its pod), and each replica's load as the router sees it.

The router is a measuring instrument, kept small: users run llm-d or Dynamo. `PrefixIndex`
learns the chain of block hashes from the events' tokens (vLLM's own cache always sends
them; the engine's tiers with ``self_describing_kv_events``), so it computes no hash itself,
and scores a prompt per replica as the sum, over its leading blocks that replica holds, of
the best weight of the places it holds each (`WEIGHTS`). What it learned of the chain is
never forgotten: a benchmark's blocks. `KvEventsIndex` feeds it from a `KvEventsSubscriber`:
one ZMQ SUB socket bound on 127.0.0.1, to which replica i's vLLM publisher connects with the
topic ``replica-<i>`` (`publisher_config`).

Thread: `KvEventsSubscriber` receives on a thread of its own; `Routing.choose`, `started` and
`finished` run on the client's event loop thread.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import Any

from tiering.integrations.kv_events import KvEventsSubscriber

ROUTINGS = ("round-robin", "session", "kv-events", "kv-shared")
PREFIX_ROUTINGS = ("kv-events", "kv-shared")  # those that follow the replicas' KV events
LOAD_WEIGHT = 2.0
"""``kv-shared``: the blocks of prefix credit a request in flight on a replica costs it."""
WEIGHTS = {"GPU": 1.0, "CPU": 0.8, "STORAGE/LOCAL": 0.6, "STORAGE/REMOTE": 0.4}
"""A block's weight by where a replica holds it: GPU and CPU as llm-d's scorer defaults,
local storage below memory, remote storage (loaded over the network) below local."""


def weights_arg(text: str) -> dict[str, float]:
    """``--router-weights``: ``PLACE=WEIGHT`` pairs, comma-separated, of `WEIGHTS`' places
    (any case), for example ``STORAGE/REMOTE=0.2``.

    Raises:
        ValueError: an unknown place, or a weight that is not a finite number >= 0.
    """
    weights = {}
    for pair in filter(None, (part.strip() for part in text.split(","))):
        where, _, value = pair.partition("=")
        try:
            weight = float(value)
        except ValueError:
            weight = math.nan
        if where.strip().upper() not in WEIGHTS or not (math.isfinite(weight) and weight >= 0):
            raise ValueError(f"expected PLACE=WEIGHT of {', '.join(WEIGHTS)}, each weight >= 0; got {pair!r}")
        weights[where.strip().upper()] = weight
    return weights


def place(medium: str | None, locality: str | None) -> str:
    """The `WEIGHTS` key of an event's medium and locality (no medium: vLLM's own cache)."""
    if medium in (None, "GPU", "CPU"):
        return medium or "GPU"
    return f"{medium}/{locality or 'LOCAL'}"


class PrefixIndex:
    """Where each of `replicas` holds which blocks, from their KV events (`apply`);
    `block_size`: tokens per block (vLLM's); `shared_places`: the places (`place`) that are
    a tier every replica reads. Thread-safe."""

    def __init__(
        self,
        replicas: int,
        block_size: int,
        weights: dict[str, float] | None = None,
        shared_places: frozenset[str] = frozenset(),
    ):
        self.replicas, self.block_size = replicas, block_size
        self.weights = {**WEIGHTS, **(weights or {})}
        self.shared_places = shared_places
        self.events = 0
        self._chain: dict[tuple[Any, tuple[int, ...]], Any] = {}  # (parent hash, block's tokens) -> hash
        self._held: list[dict[Any, set[str]]] = [{} for _ in range(replicas)]  # hash -> places
        self._shared: dict[Any, set[int]] = {}  # hash -> replicas that announced it in a shared place
        self._lock = threading.Lock()

    def scores(self, tokens: Sequence[int], shared_credit: bool = False) -> list[float]:
        """Per replica, the weighted length of the prefix of `tokens` it holds, blocks; with
        `shared_credit`, a block in a shared place counts for every replica, at least at the
        weight of remote storage."""
        out = [0.0] * self.replicas
        remote = self.weights["STORAGE/REMOTE"]
        with self._lock:
            hashes, parent = [], None
            for end in range(self.block_size, len(tokens) + 1, self.block_size):
                parent = self._chain.get((parent, tuple(tokens[end - self.block_size : end])))
                if parent is None:
                    break
                hashes.append(parent)
            for replica, held in enumerate(self._held):
                for block_hash in hashes:
                    places = held.get(block_hash)
                    credit = remote if shared_credit and self._shared.get(block_hash) else None
                    if not places and credit is None:
                        break
                    own = max((self.weights.get(where, 0.0) for where in places or ()), default=0.0)
                    out[replica] += max(own, credit or 0.0)
        return out

    def apply(self, replica: int, events: Sequence[Any]) -> None:
        """Replica `replica`'s `events` (vLLM's ``BlockStored``, ``BlockRemoved`` and
        ``AllBlocksCleared``, told apart by their class names), in order."""
        with self._lock:
            self.events += len(events)
            for event in events:
                self._apply(replica, event)

    def _apply(self, replica: int, event: Any) -> None:
        held, kind = self._held[replica], type(event).__name__
        if kind == "AllBlocksCleared":
            for places in held.values():
                places.discard("GPU")
            return
        where = place(event.medium, event.locality)
        shared = where in self.shared_places
        if kind == "BlockRemoved":
            for block_hash in event.block_hashes:
                held.get(block_hash, set()).discard(where)
                if shared:
                    self._shared.get(block_hash, set()).discard(replica)
            return
        parent, size = event.parent_block_hash, event.block_size
        for i, block_hash in enumerate(event.block_hashes):
            if size and len(event.token_ids) >= (i + 1) * size:  # a self-describing event: learn the chain
                self._chain[(parent, tuple(event.token_ids[i * size : (i + 1) * size]))] = block_hash
            parent = block_hash
            held.setdefault(block_hash, set()).add(where)
            if shared:
                self._shared.setdefault(block_hash, set()).add(replica)


class KvEventsIndex(PrefixIndex):
    """A `PrefixIndex` fed by the replicas' vLLM publishers (`KvEventsSubscriber`)."""

    def __init__(self, *args: Any, **kwargs: Any):
        """`PrefixIndex`'s arguments; the subscriber's socket is bound."""
        super().__init__(*args, **kwargs)
        self._subscriber = KvEventsSubscriber(
            lambda topic, _sequence, events: self.apply(int(topic.removeprefix("replica-")), events), "replica-"
        )

    def publisher_config(self, replica: int) -> dict[str, Any]:
        """vLLM's ``--kv-events-config`` for `replica`: publish to this index."""
        return {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self._subscriber.endpoint,
            "topic": f"replica-{replica}",
        }

    def close(self) -> None:
        self._subscriber.close()


class Routing:
    """`name` (one of `ROUTINGS`) over `replicas`; `conversation_of[i]`: request i's
    conversation (``session``); `index`: the KV events (``kv-events``, ``kv-shared``);
    `load_weight`: ``kv-shared``'s cost of a request in flight, blocks of credit."""

    def __init__(
        self,
        name: str,
        replicas: int,
        conversation_of: Sequence[int],
        index: KvEventsIndex | None = None,
        load_weight: float = LOAD_WEIGHT,
    ):
        if name not in ROUTINGS or (name in PREFIX_ROUTINGS) != (index is not None):
            known, prefix = ", ".join(ROUTINGS), " and ".join(PREFIX_ROUTINGS)
            raise ValueError(f"routing {name!r}: expected one of {known}, {prefix} with an index")
        self.name, self.replicas, self.index, self.load_weight = name, replicas, index, load_weight
        self._conversation_of = conversation_of
        self._sessions: dict[int, int] = {}
        self.in_flight = [0] * replicas
        self.sent = [0] * replicas
        self.down: set[int] = set()  # replicas out of service

    def leave(self, replica: int) -> None:
        """`replica` takes no more requests (killed, or restarting)."""
        self.down.add(replica)

    def join(self, replica: int) -> None:
        """`replica` takes requests (again)."""
        self.down.discard(replica)

    def choose(self, request: int, tokens: Sequence[int]) -> int:
        """The replica in service request `request` (its prompt `tokens`) goes to; counted
        as sent.

        Raises:
            RuntimeError: no replica is in service.
        """
        live = [replica for replica in range(self.replicas) if replica not in self.down]
        if not live:
            raise RuntimeError("no replica in service")
        if self.name == "round-robin":
            replica = live[request % len(live)]
        elif self.name == "session":
            conversation = self._conversation_of[request]
            replica = self._sessions.get(conversation, -1)
            if replica not in live:  # a new conversation, or its replica left
                replica = self._sessions[conversation] = live[len(self._sessions) % len(live)]
        else:
            assert self.index is not None
            shared = self.name == "kv-shared"
            scores = self.index.scores(tokens, shared_credit=shared)
            load = self.load_weight if shared else 0.0
            replica = max(live, key=lambda r: (scores[r] - load * self.in_flight[r], -self.in_flight[r], -self.sent[r]))
        self.sent[replica] += 1
        return replica

    def started(self, replica: int) -> None:
        self.in_flight[replica] += 1

    def finished(self, replica: int) -> None:
        self.in_flight[replica] -= 1
