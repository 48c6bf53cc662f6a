"""The scheduler loop: replay requests through a `SimulatedEngine`, one step at a time.

For each request: blocks already in the GPU prefix cache are GPU hits; the rest of the
prefix is looked up in the offloading manager up to its first miss (an answer of None delays
the request to the next step, as a real scheduler would, and the prefix is looked up again);
hits are loaded into GPU blocks (and verified), the remaining blocks are computed and stored.
Every manager call is timed; hits are counted in tokens by the tier that served them.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tiering import ReqContext, make_offload_key
from tiering.benchmarks.loadgen.workload import Request
from tiering.eviction.retention import HINT_KEY

if TYPE_CHECKING:
    from tiering.benchmarks.loadgen.engine import SimulatedEngine


@dataclass
class RunStats:
    """What a run measured. Durations in seconds; call latencies in nanoseconds."""

    requests: int = 0
    tokens: Counter = field(default_factory=Counter)  # by source: gpu, cpu, a tier name, miss
    tenant_tokens: dict[str, Counter] = field(default_factory=dict)  # the same, by tenant (requests naming one)
    verify_failures: int = 0
    failed_loads: int = 0
    store_refused_blocks: int = 0  # prepare_store found no evictable room
    calls_ns: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    promotion_s: list[float] = field(default_factory=list)
    lag_s: list[float] = field(default_factory=list)
    timeline: list[tuple[int, dict[str, int]]] = field(default_factory=list)  # (request, tokens so far)
    wall_s: float = 0.0
    interrupted: bool = False  # stopped early (Ctrl-C, SIGTERM): the numbers cover `requests` only


def block_key(block: int, tenant: str | None) -> bytes:
    """The key of block id `block` of a request of `tenant`: as vLLM mixes a request's
    ``cache_salt`` into its block hashes, a tenant's blocks never share a key with another's."""
    block_hash = block.to_bytes(8, "big")
    if tenant is not None:
        block_hash = hashlib.blake2b(block_hash, digest_size=16, key=tenant.encode()[:64]).digest()
    return make_offload_key(block_hash, 0)


class SchedulerLoop:
    """Drives one engine over a request stream."""

    def __init__(self, engine: SimulatedEngine, verify: bool = False, step_s: float = 0.0005, max_steps: int = 2000):
        """
        Args:
            verify: compare every loaded block with its payload.
            step_s: the pause standing for a model step while a lookup waits (None).
            max_steps: steps a lookup may wait before the block counts as a miss.
        """
        self.engine = engine
        self.manager = engine.manager
        self.verify = verify
        self.step_s = step_s
        self.max_steps = max_steps
        self.stats = RunStats()
        self._trace_s = 0.0  # the trace's clock: the arrival of the request being served, seconds

    def _call(self, name: str, function: Callable[..., Any], *args: Any) -> Any:
        start = time.perf_counter_ns()
        result = function(*args)
        self.stats.calls_ns[name].append(time.perf_counter_ns() - start)
        return result

    def run(
        self,
        requests: Sequence[Request],
        time_scale: float = 0.0,
        on_request: Callable[[], None] | None = None,
        stop: threading.Event | None = None,
    ) -> RunStats:
        """Replay `requests`; with `time_scale` > 0, request i starts no earlier than
        ``timestamp_ms / 1000 * time_scale`` seconds after the first. Returns `RunStats`.

        Setting `stop` (from a signal handler, say) ends the replay before the next request,
        so no engine call is cut in half; a KeyboardInterrupt ends it at once. Either way
        ``interrupted`` is set and the numbers cover the requests served.
        """
        stop = stop or threading.Event()
        retention = self.manager.primary_tier.retention
        if retention is not None:  # retention deadlines in the trace's seconds, whatever the replay's pace
            retention.clock = lambda: self._trace_s
        start = time.perf_counter()
        try:
            for index, request in enumerate(requests):
                if time_scale > 0:
                    due = start + request.timestamp_ms / 1000.0 * time_scale
                    wait = due - time.perf_counter()
                    if wait > 0:
                        stop.wait(wait)
                    self.stats.lag_s.append(max(0.0, -wait))
                if stop.is_set():
                    break
                self._serve(index, request)
                if index % 50 == 0 or index == len(requests) - 1:
                    self.stats.timeline.append((index + 1, dict(self.stats.tokens)))
                if on_request is not None:
                    on_request()
        except KeyboardInterrupt:
            stop.set()
        if stop.is_set() and self.stats.requests < len(requests):
            self.stats.interrupted = True
            self.stats.timeline.append((self.stats.requests, dict(self.stats.tokens)))
        self._settle()
        self.stats.wall_s = time.perf_counter() - start
        return self.stats

    def _serve(self, index: int, request: Request) -> None:
        engine, stats = self.engine, self.stats
        self._trace_s = request.timestamp_ms / 1000.0
        params = None if request.hint is None else {HINT_KEY: request.hint}
        context = ReqContext(f"req-{index}", kv_transfer_params=params, tenant=request.tenant)
        self._call("on_new_request", self.manager.on_new_request, context)
        # A partial last block is computed, never cached (`Request.full_blocks`).
        keys = [block_key(block, request.tenant) for block in request.hash_ids[: request.full_blocks()]]
        tokens = request.block_tokens()
        gpu_hits = engine.gpu_prefix(keys)
        offload_hits, sources = self._lookup_prefix(keys[gpu_hits:], context)
        offload_hits = self._resident_prefix(keys[gpu_hits : gpu_hits + offload_hits])
        hit_keys = keys[gpu_hits : gpu_hits + offload_hits]
        if hit_keys and not self._load(hit_keys, keys, context):
            offload_hits = 0
            hit_keys = []
        missed = keys[gpu_hits + offload_hits :]
        # As vLLM's connector offers blocks (block-level requests): after a load, the blocks
        # past the loaded ones; else every full block, the GPU cache's hits too, which the
        # engine counts as a reuse of those it holds. Its uses are ranked when it finishes.
        offered = missed if offload_hits else keys
        self._compute_and_store(missed, offered, keys, context)
        self._call("on_schedule_end", self.manager.on_schedule_end)
        self._call("on_request_finished", self.manager.on_request_finished, context)
        stats.requests += 1
        served = Counter({"gpu": sum(tokens[:gpu_hits]), "miss": sum(tokens[gpu_hits + offload_hits :])})
        for position, source in enumerate(sources[:offload_hits], start=gpu_hits):
            served[source] += tokens[position]
        stats.tokens.update(served)
        if request.tenant is not None:
            stats.tenant_tokens.setdefault(request.tenant, Counter()).update(served)

    def _lookup_prefix(self, keys: list[bytes], context: ReqContext) -> tuple[int, list[str]]:
        """How many leading `keys` are offload hits, and which tier served each.

        As vLLM's scheduler does: each step looks up the prefix up to its first miss, going
        on past None answers so that every promotion the prefix needs is queued in the same
        step, and repeats that every step until no lookup answers None; only then are the
        hits final (a promotion queued in an earlier step may have evicted a block that
        answered True before it). The hits are the leading True answers.
        """
        holders: dict[bytes, str] = {}
        waiting_since: float | None = None
        for step in range(self.max_steps + 1):
            sources: list[str] = []
            waiting = False
            for key in keys:
                if key not in holders:
                    holder = self._holder(key, context)
                    if holder is not None:
                        holders[key] = holder
                answer = self._call("lookup", self.manager.lookup, key, context)
                if answer is False:
                    break
                if answer is None:
                    waiting = True
                elif not waiting:
                    # unknown at first sight (a probe was in flight): the tier it was promoted from
                    sources.append(holders.get(key) or self.manager.promotion_source(key) or "cpu")
            if not waiting or step == self.max_steps:
                break
            waiting_since = waiting_since or time.perf_counter()
            time.sleep(self.step_s)  # a model step passes
            self._call("on_schedule_end", self.manager.on_schedule_end)
        if waiting_since is not None and not waiting:
            self.stats.promotion_s.append(time.perf_counter() - waiting_since)
        return len(sources), sources

    def _resident_prefix(self, hit_keys: list[bytes]) -> int:
        """How many leading `hit_keys` the CPU tier still holds. A lookup that gave up
        waiting (`max_steps`) may have queued promotions whose rows evicted blocks that
        answered True earlier in the same pass (a prefix longer than the CPU tier thrashes
        so); the scheduler recomputes those instead of loading them."""
        for count, key in enumerate(hit_keys):
            ref_count = self.manager.primary_tier.ref_count(key)
            if ref_count is None or ref_count < 0:
                return count
        return len(hit_keys)

    def _holder(self, key: bytes, context: ReqContext) -> str | None:
        """The tier a hit on `key` would come from: the CPU tier, or the first secondary
        tier that holds it; None while a tier is still unsure (its existence probe is in
        flight: the next step asks again)."""
        if self.manager.primary_tier.lookup(key, context) is not False:
            return "cpu"
        for name, tier in zip(self.manager.tier_names, self.manager.secondary_tiers, strict=True):
            answer = tier.lookup(key, context)
            if answer:
                return name
            if answer is None:
                return None
        return "cpu"

    def _load(self, hit_keys: list[bytes], keys: list[bytes], context: ReqContext) -> bool:
        slots = self.engine.allocate(hit_keys, keep=set(keys))
        if slots is None:
            return False
        spec = self._call("prepare_load", self.manager.prepare_load, hit_keys, context)
        loaded = self.engine.load(spec.block_ids, slots)
        self._call("complete_load", self.manager.complete_load, hit_keys, context)
        if self.verify and loaded:
            self.stats.verify_failures += self.engine.verify(hit_keys, slots)
        if not loaded:
            self.stats.failed_loads += 1
            self.engine.forget(hit_keys)
        return loaded

    def _compute_and_store(
        self, missed: list[bytes], offered: list[bytes], keys: list[bytes], context: ReqContext
    ) -> None:
        """Compute the `missed` blocks into GPU slots, then offer `offered` (the GPU holds
        them all) to the engine and store the ones it takes."""
        slots = self.engine.allocate(missed, keep=set(keys))
        if slots is None:
            return
        if missed:
            self.engine.compute(missed, slots)
        if not offered:
            return
        out = self._call("prepare_store", self.manager.prepare_store, offered, context)
        if out is None:
            self.stats.store_refused_blocks += len(missed)
            return
        if not out.keys_to_store:
            return
        stored = self.engine.store(self.engine.slots(out.keys_to_store), out.store_spec.block_ids)
        self._call("complete_store", self.manager.complete_store, out.keys_to_store, context, stored)

    def _settle(self, timeout_s: float = 60.0) -> None:
        """Let the cascades in flight land, so the tiers' counters are complete."""
        deadline = time.perf_counter() + timeout_s
        while self.manager.has_pending_work() and time.perf_counter() < deadline:
            for tier in self.manager.secondary_tiers:
                tier.drain(0.05)
            self.manager.on_schedule_end()
