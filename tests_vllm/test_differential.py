"""The same request sequences through vLLM's own CPU manager and through this engine behind
the adapter, compared call by call: every lookup answer, every store's keys and evicted
keys (in order), every step's events. Requests share prefixes, overlap, finish out of
order, complete their stores with sets as vLLM's connector does, and live through resets
with transfers in flight."""

import random
import uuid

import pytest
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager as VllmCPUManager
from vllm.v1.kv_offload.cpu.policies.arc import ARCCachePolicy as VllmARC

from tests_vllm.conftest import offloading_config
from tiering.integrations import vllm as adapter

ROWS = 16
ROW_BYTES = 64 << 10  # 2 GPU blocks of 32 KiB (see offloading_config)
TOKENS_PER_ROW = 64


class ARCWithGhostsToT2(VllmARC):
    """vLLM's ARC with this engine's one deliberate difference (see
    `tiering.eviction.policies.ARCCachePolicy`): a key stored again while in a ghost list enters T2."""

    def insert(self, key, chunk):
        ghost = key in self.b1 or key in self.b2
        super().insert(key, chunk)
        if ghost:
            self.t2[key] = self.t1.pop(key)


VLLM_POLICIES = {"lru": ("lru", None), "arc": ("ARCWithGhostsToT2", __name__)}


class Request:
    """A request as vLLM's connector drives it: its keys (with token positions recorded in
    its context), the load or store jobs in flight and the step each one completes at."""

    def __init__(self, req_id: str, names: list[bytes], groups: int):
        self.keys = [make_offload_key(name, 0) for name in names]  # a full-attention group: every block
        # a second group as a sliding window's: the last two blocks, looked up tail first
        self.tail = [make_offload_key(name, 1) for name in names[-2:]] if groups == 2 else []
        self.contexts = [ReqContext(req_id), ReqContext(req_id)]  # vLLM's manager, ours
        for context in self.contexts:
            for position, name in enumerate(names, start=1):
                for key in (self.keys[position - 1], *(k for k in self.tail if k[:-4] == name)):
                    context.set_offload_key_position(key, position * TOKENS_PER_ROW)
        self.jobs: list[tuple[int, str, object]] = []  # (due step, "load" | "store", keys)
        self.looked_up = False


def request_names(rng: random.Random) -> list[bytes]:
    """A chat-like prompt's block hashes: one of 3 system prompts, then a conversation's
    turns (a prefix of one of 12 conversations), 2 to 9 rows in all."""
    system = [f"sys{rng.randrange(3)}-{i}" for i in range(2)]
    conversation = rng.randrange(12)
    turns = [f"{system[0]}/conv{conversation}-{i}" for i in range(rng.randrange(7) + 1)]
    return [name.encode().ljust(16, b".") for name in system + turns]


def events(manager) -> list[tuple]:
    return [(list(event.keys), event.medium, event.removed) for event in manager.take_events()]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("groups", [1, 2], ids=["one-group", "full-and-sliding-groups"])
def test_this_engine_and_vllms_cpu_manager_agree_call_by_call(policy, seed, groups):
    """With two groups, a request's blocks are keys of either group: the second looked up
    tail first and stored before the first (out of prefix order), as a sliding window's."""
    name, module = VLLM_POLICIES[policy]
    vllm_manager = VllmCPUManager(ROWS, name, cache_policy_module_path=module, enable_events=True)
    extra = {"cpu_bytes_to_use": ROWS * ROW_BYTES, "eviction_policy": policy}
    config = offloading_config(extra, engine_id=f"diff-{uuid.uuid4().hex[:8]}", events=True)
    spec = adapter.KVTieringOffloadingSpec(config)
    managers = (vllm_manager, spec.get_manager())
    rng = random.Random(seed)
    live: list[Request] = []
    calls = evictions = 0

    def both(method: str, request: Request, argument):
        nonlocal calls
        calls += 1
        return [getattr(m, method)(argument, ctx) for m, ctx in zip(managers, request.contexts, strict=True)]

    try:
        for step in range(400):
            if rng.random() < 0.7:
                live.append(Request(f"req-{step}", request_names(rng), groups))
            for request in list(live):
                for job in [job for job in request.jobs if job[0] <= step]:
                    request.jobs.remove(job)
                    both("complete_load" if job[1] == "load" else "complete_store", request, job[2])
                if request.looked_up:
                    if not request.jobs:
                        for manager, context in zip(managers, request.contexts, strict=True):
                            manager.on_request_finished(context)
                        live.remove(request)
                    continue
                hits, deferred = 0, False
                for key in request.keys:  # as the scheduler's prefix lookup: on to the first miss
                    ours, theirs = both("lookup", request, key)[::-1]
                    assert ours is theirs, f"step {step}: lookup {key!r}: vLLM {theirs}, ours {ours}"
                    if theirs is LookupResult.MISS:
                        break
                    hits += theirs is LookupResult.HIT and not deferred
                    deferred |= theirs is not LookupResult.HIT
                tail_hits = []
                for key in reversed(request.tail):  # a sliding window's lookup: from the end
                    if deferred:
                        break
                    ours, theirs = both("lookup", request, key)[::-1]
                    assert ours is theirs, f"step {step}: lookup {key!r}: vLLM {theirs}, ours {ours}"
                    if theirs is LookupResult.MISS:
                        break
                    deferred |= theirs is not LookupResult.HIT
                    tail_hits.append(key)
                if deferred:
                    continue  # asked again next step
                request.looked_up = True
                if tail_hits:
                    both("prepare_load", request, tail_hits)
                    request.jobs.append((step + rng.randrange(3), "load", tail_hits))
                if hits:
                    loaded = request.keys[:hits]
                    specs = both("prepare_load", request, loaded)
                    assert [len(s.block_ids) for s in specs] == [hits, hits]
                    request.jobs.append((step + rng.randrange(3), "load", loaded))
                offered = request.keys if rng.random() < 0.5 else request.keys[hits:]
                tail = [key for key in request.tail if key not in tail_hits]
                for keys in ([tail] if tail else []) + [offered]:  # the tail's store first: out of order
                    vllm_out, our_out = both("prepare_store", request, keys)
                    if vllm_out is None or our_out is None:
                        assert vllm_out is our_out, f"step {step}: a store refused by one manager only"
                        continue
                    assert our_out.keys_to_store == vllm_out.keys_to_store, f"step {step}"
                    assert our_out.evicted_keys == vllm_out.evicted_keys, f"step {step}: evicted"
                    evictions += len(vllm_out.evicted_keys)
                    if vllm_out.keys_to_store:  # the connector completes a store with a set
                        request.jobs.append((step + rng.randrange(3), "store", set(vllm_out.keys_to_store)))
            if step % 97 == 96:  # a reset with transfers in flight: vLLM drops their completions
                for manager in managers:
                    manager.reset_cache()
                for request in live:
                    request.jobs.clear()
            for manager in managers:
                manager.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=()))
            assert events(managers[1]) == events(managers[0]), f"step {step}: events"
    finally:
        spec.shutdown()
    assert calls > 1500 and evictions > 200, (calls, evictions)  # the sequence put both managers under pressure
