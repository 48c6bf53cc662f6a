"""Walk one engine through store, cascade, eviction and promotion, printing what happens.

A CPU primary tier of 4 blocks in shared memory, with the `example` secondary tier behind it
(it records which keys it holds and copies no bytes). Run: ``python examples/quickstart.py``.
"""

from __future__ import annotations

import os

from tiering import (
    CPUPrimaryTierOffloadingManager,
    ReqContext,
    SecondaryTierFactory,
    SharedOffloadRegion,
    TieringOffloadingManager,
    make_offload_key,
)


def name(key: bytes) -> str:
    return key[:-4].decode()


def names(keys) -> str:
    return " ".join(name(k) for k in keys) or "-"


def show_events(manager: TieringOffloadingManager) -> None:
    for event in manager.take_events():
        print(f"    event: {'removed from' if event.removed else 'stored in'} {event.medium}: {names(event.keys)}")


def main() -> None:
    region = SharedOffloadRegion(f"quickstart-{os.getpid()}", num_blocks=4, cpu_page_size=4096)
    primary = CPUPrimaryTierOffloadingManager(4, region, cache_policy="lru", enable_events=True)
    tier = SecondaryTierFactory.create_secondary_tier({"type": "example"}, primary.get_kv_memoryview(), None)
    manager = TieringOffloadingManager(primary, [tier], enable_events=True)
    print(f"primary tier: 4 blocks of {region.row_bytes} bytes in {region.path}; secondary tier: {tier.tier_type}")
    request = ReqContext("chat-1")
    try:
        for step, blocks in enumerate(["ABCD", "EF"], start=1):
            keys = [make_offload_key(b.encode(), 0) for b in blocks]
            out = manager.prepare_store(keys, request)
            print(f"step {step}: store {names(keys)} into rows {out.store_spec.block_ids.tolist()}")
            if out.evicted_keys:
                print(f"    evicted from the primary tier to make room: {names(out.evicted_keys)}")
            manager.complete_store(out.keys_to_store, request)  # the GPU->CPU copy finished
            print(f"    cascaded to {tier.tier_type} (it now holds {tier.get_num_blocks()} blocks)")
            manager.on_schedule_end()
            show_events(manager)

        wanted = [make_offload_key(b.encode(), 0) for b in "AB"]
        step = 3
        while True:
            answers = {name(k): manager.lookup(k, request) for k in wanted}
            print(f"step {step}: lookup {answers}")
            manager.on_schedule_end()
            show_events(manager)
            if all(answers.values()):
                break
            step += 1
        spec = manager.prepare_load(wanted, request)
        print(f"    promoted back: load {names(wanted)} from primary rows {spec.block_ids.tolist()} to the GPU")
        manager.complete_load(wanted, request)
    finally:
        manager.shutdown()
    print(f"shut down; {region.path} removed: {not region.path.exists()}")


if __name__ == "__main__":
    main()
