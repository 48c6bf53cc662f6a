"""The ``mooncake`` tier against a real Mooncake Store pool: a ``mooncake_master`` and a
``mooncake_client`` member (a separate process that mounts the pool's memory), alone in a
network namespace the fixture makes (`tiering.testing.mooncake_pool`)."""

import asyncio
import ipaddress

import pytest

from tiering.testing.mooncake_pool import unavailable

why = unavailable()
if why:
    pytest.skip(f"no Mooncake pool here: {why}", allow_module_level=True)

from tiering.backends.mooncake import MooncakeBlockStore  # noqa: E402
from tiering.backends.mooncake.client import MooncakeOptions  # noqa: E402
from tiering.testing import BlockStoreSuite, StoreKit  # noqa: E402
from tiering.testing.block_store import FINGERPRINT, key, payload  # noqa: E402
from tiering.testing.mooncake_pool import MooncakePool, tcp_sockets  # noqa: E402


@pytest.fixture(scope="module")
def pool():
    started = MooncakePool(segment_bytes=256 << 20)
    yield started
    started.stop()


def tier_options(pool, key_prefix, **extra):
    """A small tier's options on `pool`: a client contributing no memory, unless `extra` says."""
    values = {"segment_bytes": 0, "staging_bytes": 8 << 20, "threads": 2, "key_prefix": key_prefix}
    return pool.tier_options(**{**values, **extra})


def options(pool, key_prefix, **extra):
    return MooncakeOptions(**tier_options(pool, key_prefix, recover_index=True, **extra))


@pytest.fixture
def store_kit(pool, key_prefix):
    def make(fingerprint):
        return MooncakeBlockStore(fingerprint, options(pool, key_prefix))

    def read_raw(store, key):
        client = store._client
        return client.submit(lambda: client.store.get(store.object_name(key))).result()

    def write_raw(store, key, raw):
        client = store._client
        assert client.submit(lambda: client.store.upsert(store.object_name(key), raw)).result() == 0

    return StoreKit(make=make, read_raw=read_raw, write_raw=write_raw)


class TestBlockStoreConformance(BlockStoreSuite):
    """Every test of `tiering.testing.BlockStoreSuite`, on a pool whose memory another process
    mounts (the stores contribute none: closing one loses nothing of the pool's)."""


@pytest.mark.asyncio
async def test_objects_are_named_by_prefix_namespace_and_key(pool, key_prefix):
    store = MooncakeBlockStore(FINGERPRINT, options(pool, key_prefix))
    await store.open()
    try:
        await store.put(key(1), payload(4096))
        assert f"{key_prefix}:{FINGERPRINT.hex()}:{key(1).hex()}" in pool.object_names()
    finally:
        await store.close()


@pytest.mark.asyncio
async def test_a_store_that_contributes_memory_keeps_blocks_in_its_own_segment(pool, key_prefix):
    store = MooncakeBlockStore(FINGERPRINT, options(pool, key_prefix, segment_bytes=32 << 20))
    await store.open()
    try:
        segments = pool.segments()
        assert store._client.hostname in segments and len(segments) == 2
        await store.put(key(1), payload(4096))
        where = pool.admin_get(f"/query_key?key={store.object_name(key(1))}").decode()
        assert store._client.hostname in where
    finally:
        await store.close()
    assert len(pool.segments()) == 1  # unmounted: its blocks left the pool with it


def test_every_socket_of_the_pool_and_its_clients_stays_on_loopback(pool, key_prefix):
    """The pool and the tiers' clients live in the fixture's namespace, whose only interface
    is lo; while the store is open, this process holds sockets there and none of theirs in the
    machine's own namespace."""
    import os

    async def use() -> tuple[set[str], set[tuple[str, str]], set[tuple[str, str]]]:
        store = MooncakeBlockStore(FINGERPRINT, options(pool, key_prefix, segment_bytes=16 << 20))
        await store.open()
        try:
            await store.put(key(1), payload(65536))
            into = memoryview(bytearray(65536))
            await store.get(key(1), into)
            there = set(pool.namespace.tcp_sockets(owner=os.getpid()))
            here = set(tcp_sockets("/proc/self/net", owner=os.getpid()))  # the main thread's namespace
            return {local for local, _ in pool.namespace.tcp_sockets()}, there, here
        finally:
            await store.close()

    before = set(tcp_sockets("/proc/self/net", owner=os.getpid()))
    in_namespace, ours_there, ours_here = asyncio.run(use())
    assert pool.namespace.interfaces() == ["lo"]
    assert ours_there  # the store's listener and connections went into the namespace
    for local, remote in pool.namespace.tcp_sockets():
        for address in (local, remote):
            host = address.rpartition(":")[0].strip("[]")
            assert host in ("0.0.0.0", "0" * 32) or ipaddress.ip_address(host).is_loopback, address
    ports = {address.rpartition(":")[2] for address in in_namespace}
    leaked = {local for local, _ in ours_here - before if local.rpartition(":")[2] in ports}
    assert not leaked  # none of the store's sockets in this machine's own namespace


@pytest.mark.asyncio
async def test_a_frozen_master_fails_calls_and_a_thawed_one_serves_again(pool, key_prefix):
    store = MooncakeBlockStore(FINGERPRINT, options(pool, key_prefix))
    await store.open()
    try:
        await store.put(key(1), payload(4096))
        pool.freeze()
        try:  # the call hangs (the tier's op_timeout_s ends it) or fails: never an answer
            with pytest.raises((TimeoutError, OSError)):
                await asyncio.wait_for(store.exists(key(1)), 2.0)
        finally:
            pool.thaw()
        await store.put(key(2), payload(4096))  # served again
        assert await store.exists(key(2))
    finally:
        await store.close()


# -- the tier in an engine ------------------------------------------------------------------

FAST_FAULTS = {"op_timeout_s": 2, "failure_threshold": 2, "backoff_s": 0.2, "max_backoff_s": 0.4}


def tier_config(pool, key_prefix, **extra):
    return {"type": "mooncake", **tier_options(pool, key_prefix, **extra)}


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"capacity_bytes": "1GiB"}, "capacity_bytes is not taken: the master evicts"),
        ({"recover_index": True, "admin_address": None}, "recover_index needs admin_address"),
        ({"master_address": "localhost"}, "expected host:port"),
        ({"protocol": "ucx"}, "protocol"),
        ({"key_prefix": "kv blocks"}, "key_prefix"),
        ({"segment_bytes": "1MiB"}, "segment_bytes.*at least 16777216 bytes"),
    ],
)
def test_bad_options_fail_at_load_naming_the_key(pool, extra, message):
    from tests.helpers import ROW, RegionStandIn
    from tiering import SecondaryTierFactory, TierConfigError

    config = {**tier_config(pool, "kvt"), **extra}
    with pytest.raises(TierConfigError, match=message):
        SecondaryTierFactory.create_secondary_tier(config, RegionStandIn(4, ROW).create_kv_memoryview(), None)


def test_a_second_engine_finds_the_first_ones_blocks_by_probes(pool, key_prefix, engine_factory):
    from tests.helpers import ROW, block_bytes, keys

    config = tier_config(pool, key_prefix)
    engine_factory(config).store(0, 1, 2)
    second = engine_factory(config)
    assert len(second.tier.index) == 0  # nothing listed at start
    assert second.lookup_until_done(0, 1, 2, 3, steps=10) == [True, True, True, False]
    assert second.loaded_bytes(1) == [block_bytes(keys(1)[0], ROW)]


def test_a_frozen_master_turns_into_failed_jobs_and_misses_then_the_tier_recovers(pool, key_prefix, engine_factory):
    import time

    from tests.helpers import CTX, keys

    engine = engine_factory(tier_config(pool, key_prefix, **FAST_FAULTS), num_blocks=8)
    engine.store(0, 1)
    pool.freeze()
    try:
        engine.store(2, 3)
        engine.store(4, 5)
        assert not engine.tier.health.healthy
        assert engine.tier.failures["store"] >= 2
        assert engine.tier.lookup(keys(0)[0], CTX) is False  # an unhealthy tier answers misses
    finally:
        pool.thaw()
    deadline = time.monotonic() + 30
    while not engine.tier.health.healthy:
        assert time.monotonic() < deadline, "the tier did not recover"
        engine.settle()
        time.sleep(0.05)
    engine.store(6, 7)
    assert engine.tier.lookup(keys(0)[0], CTX) is True  # the pool kept its blocks


def test_config_check_connect_reaches_the_master_and_names_one_that_does_not_answer(pool, key_prefix, tmp_path, capsys):
    import yaml

    from tiering.config_check import main as config_main

    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    tier = tier_config(pool, key_prefix, segment_bytes=16 << 20)
    good.write_text(yaml.safe_dump({"cpu_bytes_to_use": "64MiB", "secondary_tiers": [tier]}))
    bad.write_text(
        yaml.safe_dump({"cpu_bytes_to_use": "64MiB", "secondary_tiers": [{**tier, "master_address": "127.0.0.1:1"}]})
    )
    assert config_main(["check", str(good), "--connect"]) == 0
    assert config_main(["check", str(bad), "--connect"]) != 0
    assert "the Mooncake master at 127.0.0.1:1 does not answer" in capsys.readouterr().err


@pytest.mark.asyncio
async def test_an_engine_that_leaves_the_pool_costs_the_others_misses_only(pool, key_prefix):
    from tiering import ObjectNotFoundError

    lender = MooncakeBlockStore(FINGERPRINT, options(pool, key_prefix, segment_bytes=32 << 20))
    reader = MooncakeBlockStore(FINGERPRINT, options(pool, key_prefix))
    await lender.open()
    await reader.open()
    try:
        block = payload(65536)
        await lender.put(key(1), block)  # into the lender's own segment
        into = memoryview(bytearray(65536))
        await reader.get(key(1), into)
        assert into == block
        await lender.close()  # its segment is unmounted, with the block in it
        assert await reader.exists_many([key(1)]) == [False]
        with pytest.raises(ObjectNotFoundError):
            await reader.get(key(1), into)
        await reader.put(key(2), block)  # the pool serves on with the member's memory
        assert await reader.exists(key(2))
    finally:
        await lender.close()
        await reader.close()


def test_a_killed_master_fails_jobs_and_once_restarted_the_tier_stores_again_and_misses_the_lost(
    pool, key_prefix, engine_factory
):
    """While the master is dead the tier's jobs fail fast (Mooncake's RPC_FAIL) and its breaker
    opens; a new master knows no object of the old one's, and the tier stores again once the
    member has mounted its memory anew (until then: no room, not a failure)."""
    import time

    engine = engine_factory(tier_config(pool, key_prefix, **FAST_FAULTS), num_blocks=8)
    engine.store(0, 1)
    pool.kill_master()
    try:
        engine.store(2, 3)
        engine.store(4, 5)
        assert engine.tier.failures["store"] >= 2 and not engine.tier.health.healthy
    finally:
        pool.start_master()
    deadline, block = time.monotonic() + 30, 6
    while engine.tier.get_stats()["counters"]["blocks_stored"] < 3:  # 0 and 1, then one stored anew
        assert time.monotonic() < deadline, "the tier never stored again"
        engine.store(block)  # a new block each time: until the member has mounted again, no room
        engine.settle()
        block += 1
        time.sleep(0.2)
    from tests.helpers import keys

    assert engine.tier.store.object_name(keys(0)[0]) not in pool.object_names()  # the old master's are gone


def test_blocks_in_the_engines_own_segment_are_announced_local_and_the_others_remote(pool, key_prefix, engine_factory):
    """The 16 MiB segment an engine lends takes its first blocks (`prefer_local_segment`);
    the rest go to the member's. Each block's events say where the master placed its object,
    stored and removed alike."""
    from tests.helpers import keys
    from tiering.contract.mediums import LOCAL, REMOTE, STORAGE

    count = 4200  # objects of 4,224 bytes: about 3,970 fit the segment
    engine = engine_factory(tier_config(pool, key_prefix, segment_bytes=16 << 20), num_blocks=count, events=True)
    engine.store(*range(count))
    stored = {}
    for event in engine.manager.take_events():
        if event.medium == STORAGE:
            assert not event.removed
            stored.update(dict.fromkeys(event.keys, event.locality))
    assert len(stored) == count and {LOCAL, REMOTE} <= set(stored.values())
    store = engine.tier.store
    placed = pool.placements([store.object_name(k) for k in stored])
    here = store._client.hostname
    assert {k: LOCAL if here in placed[store.object_name(k)] else REMOTE for k in stored} == stored
    assert stored[keys(0)[0]] == LOCAL
    engine.manager.reset_cache()  # a new generation: every block leaves, at the locality it was announced at
    removed = {k: e.locality for e in engine.manager.take_events() if e.medium == STORAGE for k in e.keys}
    assert removed == stored


def test_the_exporter_serves_the_tiers_metrics_the_dashboard_reads(pool, key_prefix, engine_factory):
    import urllib.request

    from tiering.engine.metrics import PrometheusExporter

    engine = engine_factory(tier_config(pool, key_prefix), num_blocks=4)
    engine.store(0, 1)
    exporter = PrometheusExporter(0)
    try:
        exporter.attach(engine.manager)
        with urllib.request.urlopen(f"http://127.0.0.1:{exporter.port}/metrics", timeout=10) as response:
            text = response.read().decode()
    finally:
        exporter.close()
    for line in (
        'tiering_tier_blocks_stored_total{tier="mooncake"} 2.0',
        'tiering_tier_healthy{tier="mooncake"} 1.0',
        'tiering_tier_blocks{tier="mooncake"} 2.0',
        'tiering_tier_store_seconds_count{tier="mooncake"} 1.0',
    ):
        assert line in text, line
