"""A fleet's moments that are not steady (``tiering-bench serve --replicas N``), each with the
requests it touches reported apart (`apart`):

- ``scale-out`` (``--scale-out-at T``): the last replica is out of service until T (started
  before the replay, idle, its own tiers empty) and joins at T, as a replica a scaler adds
  once it answers; apart: the joining replica's first `FIRST_REQUESTS` requests;
- ``kill-replica`` (``--kill-replica-at T``): the last replica is killed at T (SIGKILL to
  every process of it) and leaves the router, which sends its conversations to the others;
  requests in flight on it fail. Apart: each moved conversation's first turn after T (a
  conversation that had a turn on the killed replica before T);
- ``rolling-restart`` (``--rolling-restart-at T``): from T, each replica in turn leaves the
  router, waits for its requests in flight, is stopped as a service manager stops it
  (SIGTERM, vLLM's ``--shutdown-timeout`` long enough for the engine's drain), starts again
  over its tiers on the same port and rejoins, the others serving meanwhile; apart: the
  requests that arrive from T until the last replica is back.

Thread: the actions run on the client's event loop (`tiering.benchmarks.serve.client.replay`);
the rest on the caller's.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tiering.benchmarks.serve.routing import Routing
from tiering.benchmarks.serve.server import VllmServer

SCENARIOS = {
    "scale-out": "the last replica joins at {at:g} s",
    "kill-replica": "the last replica is killed at {at:g} s",
    "rolling-restart": "every replica restarted in turn from {at:g} s",
}
FIRST_REQUESTS = 20
"""Requests of a joining replica reported apart."""

Action = tuple[float, Callable[[], Awaitable[None]]]


@dataclass(frozen=True)
class Scenario:
    """`kind` (one of `SCENARIOS`) at `at_s` seconds of the replay, to the last of `replicas`."""

    kind: str
    at_s: float
    replicas: int
    marks: dict[str, float] = field(default_factory=dict, compare=False)  # what a run saw: "back_s"

    def __post_init__(self) -> None:
        if self.kind not in SCENARIOS or self.replicas < 2:
            raise ValueError(f"scenario {self.kind!r}: expected one of {', '.join(SCENARIOS)}, with 2 replicas or more")

    @property
    def replica(self) -> int:
        """The replica that joins or is killed."""
        return self.replicas - 1

    def describe(self) -> str:
        return SCENARIOS[self.kind].format(at=self.at_s)

    def actions(self, routing: Routing, servers: list[VllmServer]) -> list[Action]:
        """What happens during the replay, each at its time; the routing as it starts
        (a replica that joins later is out of service until then). A restart replaces its
        server in `servers`."""
        self.marks.clear()
        replica = self.replica
        if self.kind == "scale-out":
            routing.leave(replica)

            async def join() -> None:
                routing.join(replica)

            return [(self.at_s, join)]

        if self.kind == "kill-replica":

            async def kill() -> None:
                routing.leave(replica)
                await asyncio.to_thread(servers[replica].stop, signal.SIGKILL, True)

            return [(self.at_s, kill)]

        async def roll() -> None:
            started = time.monotonic()
            for each in range(self.replicas):
                routing.leave(each)
                while routing.in_flight[each]:  # the router drains it first
                    await asyncio.sleep(0.05)
                servers[each] = await asyncio.to_thread(servers[each].restart)
                routing.join(each)
            self.marks["back_s"] = self.at_s + time.monotonic() - started

        return [(self.at_s, roll)]

    def apart(self, outcomes: Sequence[dict[str, Any]], conversation_of: Sequence[int]) -> list[int]:
        """The indexes of the requests reported apart, in arrival order."""
        ordered = sorted(outcomes, key=lambda o: (o["arrival_s"], o["index"]))
        if self.kind == "scale-out":
            return [o["index"] for o in ordered if o["replica"] == self.replica][:FIRST_REQUESTS]
        if self.kind == "rolling-restart":
            back_s = self.marks.get("back_s", float("inf"))
            return [o["index"] for o in ordered if self.at_s <= o["arrival_s"] <= back_s]
        moved = {
            conversation_of[o["index"]] for o in ordered if o["replica"] == self.replica and o["arrival_s"] < self.at_s
        }
        firsts: dict[int, int] = {}
        for o in ordered:
            conversation = conversation_of[o["index"]]
            if o["arrival_s"] >= self.at_s and conversation in moved:
                firsts.setdefault(conversation, o["index"])
        return sorted(firsts.values())
