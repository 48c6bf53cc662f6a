"""The engine's KV events under `vllm serve`, as a KV-aware router receives them: vLLM's own
publisher (``--kv-events-config``) sends them over ZMQ to a subscriber on 127.0.0.1, which
decodes vLLM's own msgspec batches. A prompt's blocks are announced in the CPU tier and in
the file tier (its locality and name), removed from the CPU tier by a flood while the file
tier keeps them, and removed from the file tier once its capacity evicts them; with
``self_describing_kv_events`` the announcements carry the blocks' tokens. A request whose
``kv_load_tiers`` leaves the file tier out recomputes what only the file tier holds.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Callable

import pytest

from tests_vllm import tiny
from tests_vllm.conftest import prompt
from tiering.benchmarks.serve.server import ServerOptions, VllmServer, free_port
from tiering.integrations.kv_events import KvEventsSubscriber
from tiering.tiers.object_format import object_size

pytestmark = pytest.mark.timeout(600)
PROMPT = prompt(500, 300)  # 9 full blocks
FLOOD_A = [prompt(600 + i, 300) for i in range(8)]  # 72 blocks: past vLLM's 64 and the CPU tier's 32
FLOOD_B = [prompt(700 + i, 300) for i in range(12)]  # 108 blocks: past the file tier's 96
FILLER = prompt(800, 16)  # under a block: keeps the engine stepping, and no tier ever holds a block of it
FILE_BLOCKS = 96


class Subscriber:
    """A router's end of vLLM's event stream (`KvEventsSubscriber`), keeping every event."""

    def __init__(self) -> None:
        self.events: list = []
        self._lock = threading.Lock()
        self._socket = KvEventsSubscriber(self._keep)
        self.endpoint = self._socket.endpoint

    def _keep(self, _topic: str, _sequence: int, events: list) -> None:
        with self._lock:
            self.events.extend(events)

    def seen(self) -> list:
        with self._lock:
            return list(self.events)

    def close(self) -> None:
        self._socket.close()


def hashes(events: list, kind: str, medium: str, **fields) -> set:
    """Block hashes of the events of type `kind` and `medium` whose `fields` match."""
    return {
        block_hash
        for event in events
        if type(event).__name__ == kind
        and event.medium == medium
        and all(getattr(event, name) == value for name, value in fields.items())
        for block_hash in event.block_hashes
    }


class EventServer(VllmServer):
    """`vllm serve` with a 1 MiB CPU tier (32 blocks) and a file tier of `FILE_BLOCKS`,
    publishing its KV events to `subscriber`."""

    def __init__(self, model, tmp_path, subscriber: Subscriber, self_describing: bool):
        self.engine_port = free_port()
        capacity = FILE_BLOCKS * object_size(36, 32 << 10)  # keys of 32 bytes and a group index; blocks of 32 KiB
        file_tier = {"type": "file", "root_dir": str(tmp_path / "kv"), "capacity_bytes": capacity}
        engine = {"cpu_bytes_to_use": 1 << 20, "secondary_tiers": [file_tier], "metrics": {"port": self.engine_port}}
        if self_describing:
            engine["self_describing_kv_events"] = True
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": subscriber.endpoint}
        options = ServerOptions(
            engine, tiny.BLOCK, max_model_len=1024, gpu_blocks=64, extra_args=["--kv-events-config", json.dumps(events)]
        )
        super().__init__(model, options, tmp_path / "server.log")

    def complete(self, tokens: list[int], kv_transfer_params: dict | None = None) -> str:
        body: dict = {"model": self.model_name, "prompt": tokens, "max_tokens": 4, "temperature": 0}
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        request = urllib.request.Request(
            f"{self.url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.loads(response.read())["choices"][0]["text"]

    def file_hits(self) -> float:
        samples = self.metrics(self.engine_port).get("tiering_tier_hit_blocks_total", {})
        return sum(value for labels, value in samples.items() if dict(labels).get("tier") == "file")

    def wait_for(self, fact: Callable[[], bool], what: str, timeout_s: float = 120) -> None:
        """Step the engine (a request vLLM's own cache serves) until `fact` holds: events and
        counters move only when the scheduler steps."""
        deadline = time.monotonic() + timeout_s
        while not fact():
            assert time.monotonic() < deadline, f"never saw {what}"
            self.complete(FILLER)


@pytest.mark.parametrize("self_describing", [False, True], ids=["placeholders", "self-describing"])
def test_a_router_sees_each_tier_store_and_remove_a_prompts_blocks(model, tmp_path, self_describing):
    subscriber = Subscriber()
    server = EventServer(model, tmp_path, subscriber, self_describing)
    try:
        first = server.complete(PROMPT)

        def stored(medium: str, **fields) -> set:
            return hashes(subscriber.seen(), "BlockStored", medium, **fields)

        server.wait_for(lambda: len(stored("CPU")) >= 9 and len(stored("STORAGE")) >= 9, "the prompt's stores")
        events = subscriber.seen()
        ours = hashes(events, "BlockStored", "CPU", locality="LOCAL", ownership=None)
        assert len(ours) == 9  # the prompt's 9 full blocks
        assert ours <= hashes(events, "BlockStored", "STORAGE", locality="LOCAL", ownership="file")
        announced = [e for e in events if type(e).__name__ == "BlockStored" and e.medium in ("CPU", "STORAGE")]
        if self_describing:  # each announcement carries its block's tokens (vLLM's tracker kept them)
            blocks = {tuple(PROMPT[i : i + tiny.BLOCK]) for i in range(0, 9 * tiny.BLOCK, tiny.BLOCK)}
            assert {tuple(e.token_ids) for e in announced if set(e.block_hashes) <= ours} == blocks
        else:
            assert all(e.token_ids == [] for e in announced)

        for tokens in FLOOD_A:  # evicts the prompt from vLLM's cache and the CPU tier, not the file tier
            server.complete(tokens)

        def removed(medium: str) -> set:
            return hashes(subscriber.seen(), "BlockRemoved", medium) & ours

        server.wait_for(lambda: removed("CPU") == ours, "the CPU tier's removals")
        assert removed("STORAGE") == set()

        hits = server.file_hits()
        assert server.complete(PROMPT, {"kv_load_tiers": [{"medium": "cpu"}]}) == first  # recomputed, right
        assert server.file_hits() == hits  # its blocks in the file tier were misses

        for tokens in FLOOD_B:
            server.complete(tokens)
        server.wait_for(lambda: removed("STORAGE") == ours, "the file tier's removals")
        removals = [e for e in subscriber.seen() if type(e).__name__ == "BlockRemoved" and e.medium == "STORAGE"]
        assert all(e.locality == "LOCAL" and e.ownership == "file" for e in removals)
    finally:
        server.stop()
        subscriber.close()
