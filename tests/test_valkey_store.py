"""The valkey tier against real redis-server processes on 127.0.0.1: a standalone server and a
3-node cluster started by the fixtures, and servers of a test's own for the faults."""

import contextlib
import ssl
import sys
import time

import numpy as np
import pytest
import trustme

from tests.helpers import CTX, ROW, RegionStandIn, block_bytes, keys
from tiering import JobMetadata, SecondaryTierFactory, TierConfigError
from tiering.backends.valkey import ValkeyBlockStore
from tiering.config_check import main as config_main
from tiering.testing import BlockStoreSuite, StoreKit
from tiering.testing.block_store import FINGERPRINT, key
from tiering.testing.processes import free_port
from tiering.testing.valkey_server import TlsFront, ValkeyCluster, ValkeyServer
from tiering.tiers.blockstore.generations import VERSIONS_KEY


def valkey_config(target, key_prefix, **extra):
    """The config of a tier on `target` (a ValkeyServer or a ValkeyCluster)."""
    cluster = hasattr(target, "nodes")
    addresses = target.addresses[:1] if cluster else [target.address]
    return {"type": "valkey", "addresses": addresses, "cluster_mode": cluster, "key_prefix": key_prefix, **extra}


@pytest.fixture(params=["standalone", "cluster"])
def valkey_target(request):
    return request.getfixturevalue("valkey_server" if request.param == "standalone" else "valkey_cluster")


def raw_client(target, name):
    """A redis-py client of the node that holds `name`."""
    node = target.primary_of(name) if hasattr(target, "nodes") else target
    return node.admin()


@pytest.fixture
def store_kit(valkey_target, key_prefix):
    config = valkey_config(valkey_target, key_prefix)

    def make(fingerprint):
        cluster = config["cluster_mode"]
        return ValkeyBlockStore(fingerprint, config["addresses"], cluster, key_prefix, recover_index=True)

    def read_raw(store, key):
        name = store.value_name(key)
        return raw_client(valkey_target, name).get(name)

    def write_raw(store, key, raw):
        name = store.value_name(key)
        raw_client(valkey_target, name).set(name, raw)

    return StoreKit(make=make, read_raw=read_raw, write_raw=write_raw)


class TestBlockStoreConformance(BlockStoreSuite):
    """Every test of `tiering.testing.BlockStoreSuite`, on a standalone server and a cluster."""


@pytest.mark.asyncio
async def test_values_are_named_by_prefix_layout_and_key_and_spread_over_slots(store_kit, valkey_cluster, key_prefix):
    store = ValkeyBlockStore(FINGERPRINT, valkey_cluster.addresses[:1], cluster_mode=True, key_prefix=key_prefix)
    await store.open()
    try:
        for i in range(12):
            await store.put(key(i), memoryview(bytearray(64)))
        names = [store.value_name(key(i)) for i in range(12)]
        assert names[0] == f"{key_prefix}:{FINGERPRINT.hex()}:{key(0).hex()}".encode()
        owners = {valkey_cluster.primary_of(name).port for name in names}
        assert len(owners) == 3  # no hash tag: the blocks are spread over every primary
    finally:
        await store.close()


# -- config and connection errors -----------------------------------------------------------


def make_tier(config):
    return SecondaryTierFactory.create_secondary_tier(config, RegionStandIn(4, ROW).create_kv_memoryview(), None)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"capacity_bytes": "1GiB"}, "capacity_bytes is not taken: the server evicts"),
        ({"request_timeout_s": 30}, r"request_timeout_s \(30.0\) must be below op_timeout_s \(10.0\)"),
        ({"addresses": ["localhost"]}, "expected host:port"),
        ({"addresses": []}, "addresses"),
        ({"key_prefix": "kv{1}"}, "a hash tag would put every block in one slot"),
        ({"password_env": "A", "password_file": "/f"}, "set password_env or password_file, not both"),
        ({"tls_ca_file": "/ca.pem"}, "tls_ca_file needs tls: true"),
    ],
)
def test_bad_options_fail_at_load_naming_the_key(extra, message):
    config = {"type": "valkey", "addresses": ["127.0.0.1:6379"], **extra}
    with pytest.raises(TierConfigError, match=message):
        make_tier(config)


def test_the_redis_alias_is_the_same_tier(valkey_server, key_prefix, engine_factory):
    engine = engine_factory({**valkey_config(valkey_server, key_prefix), "type": "redis"})
    assert isinstance(engine.tier.store, ValkeyBlockStore)


def test_an_unset_password_variable_is_named_and_the_server_never_reached(monkeypatch):
    monkeypatch.delenv("KVT_TEST_NO_SUCH_PASSWORD", raising=False)
    config = {"type": "valkey", "addresses": ["127.0.0.1:1"], "password_env": "KVT_TEST_NO_SUCH_PASSWORD"}
    with pytest.raises(ValueError, match="the environment variable KVT_TEST_NO_SUCH_PASSWORD is not set"):
        make_tier(config)


def test_nothing_listening_is_a_clear_connection_error():
    config = {"type": "valkey", "addresses": [f"127.0.0.1:{free_port()}"], "connect_timeout_s": 0.5}
    with pytest.raises(ConnectionError, match=r"valkey tier: server 127.0.0.1:\d+: cannot connect"):
        make_tier(config)


def test_a_test_server_that_fails_to_start_says_why_from_its_stderr():
    server = ValkeyServer(settings={"no-such-directive": "1"})
    with pytest.raises(RuntimeError, match=r"redis-server on port \d+ exited with status 1: (?s:.*)no-such-directive"):
        server.start()
    server.stop()  # nothing left to stop: a no-op


def test_a_servers_exit_message_reads_only_the_end_of_a_long_stderr():
    import sys

    from tiering.testing.processes import STDERR_TAIL_BYTES, exit_message, spawn

    script = "import sys; sys.stderr.write('x' * 10_000_000 + 'the last words'); sys.exit(3)"
    process, stderr = spawn([sys.executable, "-c", script])
    with stderr:
        process.wait()
        message = exit_message("talker", process, stderr)
    assert message.startswith("talker exited with status 3: x") and message.endswith("the last words")
    assert len(message) < STDERR_TAIL_BYTES + 100


def test_a_cluster_configured_as_standalone_is_a_clear_error(valkey_cluster, key_prefix):
    config = {"type": "valkey", "addresses": valkey_cluster.addresses[:1], "key_prefix": key_prefix}
    with pytest.raises(OSError, match="is a cluster node: set cluster_mode: true"):
        make_tier(config)


def test_a_standalone_server_configured_as_a_cluster_is_a_clear_error(valkey_server, key_prefix):
    config = {"type": "valkey", "addresses": [valkey_server.address], "cluster_mode": True, "connect_timeout_s": 1}
    with pytest.raises(OSError, match="is not a cluster: set cluster_mode: false"):
        make_tier({**config, "key_prefix": key_prefix})


@pytest.fixture
def password_server():
    """A server of its own that requires a password, and has an ACL user ``kv``."""
    server = ValkeyServer(settings={"requirepass": "server-secret-never-printed"})
    server.start()
    server.admin().execute_command("ACL", "SETUSER", "kv", "on", ">kv-secret-never-printed", "~*", "+@all")
    yield server
    server.stop()


def test_passwords_come_from_a_variable_or_a_file_and_never_appear(
    password_server, key_prefix, tmp_path, monkeypatch, engine_factory, caplog
):
    monkeypatch.setenv("KVT_TEST_PASSWORD", "server-secret-never-printed")
    secret_file = tmp_path / "password"
    secret_file.write_text("kv-secret-never-printed\n")
    base = valkey_config(password_server, key_prefix)
    for config in (
        {**base, "password_env": "KVT_TEST_PASSWORD"},
        {**base, "username": "kv", "password_file": str(secret_file)},
    ):
        engine = engine_factory(config)
        engine.store(0)
        assert engine.lookup_until_done(0) == [True]
        store = engine.tier.store
        for text in (repr(engine.tier), repr(store), str(vars(store)), str(engine.tier.get_stats()), caplog.text):
            assert "never-printed" not in text
    with pytest.raises(PermissionError, match="authentication refused for user 'kv'"):
        make_tier({**base, "username": "kv", "password_env": "KVT_TEST_PASSWORD"})
    assert "never-printed" not in caplog.text


# -- the engine over the tier ---------------------------------------------------------------


def test_two_engines_share_blocks_through_one_cluster(valkey_cluster, key_prefix, engine_factory):
    config = valkey_config(valkey_cluster, key_prefix)
    first, second = engine_factory(config), engine_factory(config)
    first.store(0, 1, 2)
    assert second.lookup_until_done(0, 1, 2, 3, steps=10) == [True, True, True, False]  # probes, promotions
    assert second.loaded_bytes(0, 1, 2) == [block_bytes(k, ROW) for k in keys(0, 1, 2)]
    assert second.tier.get_stats()["counters"]["blocks_loaded"] == 3


@contextlib.contextmanager
def server_with_room(policy):
    """A server of its own under `policy`, and `leave_room(rows)`: its memory limit set to
    room for about `rows` more blocks than it uses now (call it once the engine is
    connected: a client's buffers take tens of KiB of the server's memory)."""
    server = ValkeyServer(settings={"maxmemory-policy": policy})
    server.start()
    try:
        admin = server.admin()

        def leave_room(rows=16):
            admin.config_set("maxmemory", admin.info("memory")["used_memory"] + rows * ROW)

        yield server, admin, leave_room
    finally:
        server.stop()


def test_blocks_the_server_evicted_are_misses_never_wrong_bytes(engine_factory, key_prefix):
    with server_with_room("allkeys-lru") as (server, admin, leave_room):
        engine = engine_factory(valkey_config(server, key_prefix))
        leave_room()
        for i in range(0, 40, 4):
            engine.store(i, i + 1, i + 2, i + 3)  # 4 primary rows: the tier holds the rest
        assert admin.dbsize() < 40
        hits = 0
        for i in range(40):
            if engine.lookup_until_done(i, steps=10) == [True]:  # a load of an evicted value fails: a miss
                assert engine.loaded_bytes(i) == [block_bytes(keys(i)[0], ROW)]
                hits += 1
        assert 4 < hits < 40
        assert engine.tier.failures["load_missing"] > 0


def test_a_value_of_another_type_at_a_blocks_name_is_dropped_without_opening_the_breaker(
    valkey_target, engine_factory, key_prefix
):
    """Another program's list at a block's name answers WRONGTYPE to every GET: one failed
    promotion per key, dropped; the tier stays healthy and serves the rest."""
    engine = engine_factory(valkey_config(valkey_target, key_prefix), num_blocks=8)
    engine.store(*range(8))
    engine.store(*range(8, 16))  # 0..7 now only in the tier
    for i in range(6):  # more than the breaker's threshold (5)
        name = engine.tier.store.value_name(key(i))
        client = raw_client(valkey_target, name)
        client.delete(name)
        client.rpush(name, b"not a block")
    engine.rows[:] = 0
    for i in range(6):
        assert engine.lookup_until_done(i) == [False]
    assert engine.tier.failures["load_unusable"] == 6 and engine.tier.health.healthy
    assert engine.lookup_until_done(6, 7) == [True, True]
    assert engine.loaded_bytes(6, 7) == [block_bytes(k, ROW) for k in keys(6, 7)]


def test_a_full_server_fails_stores_as_no_space_and_keeps_serving_loads(engine_factory, key_prefix):
    with server_with_room("noeviction") as (server, _, leave_room):
        engine = engine_factory(valkey_config(server, key_prefix))
        leave_room()
        engine.store(0, 1)
        for i in range(2, 40, 2):
            engine.store(i, i + 1)
        assert engine.tier.failures["store_no_space"] > 0
        assert engine.tier.health.healthy  # a full server is not a sick one
        assert engine.lookup_until_done(0, 1) == [True, True]
        assert engine.loaded_bytes(0, 1) == [block_bytes(k, ROW) for k in keys(0, 1)]
        engine.close()  # while its server runs: a stop deletes the engine's lease there


def test_values_over_the_limits_fail_their_jobs(engine_factory, key_prefix, caplog):
    server = ValkeyServer(settings={"proto-max-bulk-len": "1mb"})
    server.start()
    try:
        big_rows = RegionStandIn(2, 2 << 20)  # 2 MiB blocks: over the server's 1 MiB limit
        tier = SecondaryTierFactory.create_secondary_tier(
            {**valkey_config(server, key_prefix), "op_timeout_s": 3, "request_timeout_s": 1},
            big_rows.create_kv_memoryview(),
            None,
        )
        try:
            driver_results = _store_rows(tier, 2)
            assert driver_results == [False, False] and tier.failures["store"] == 2
            assert all(tier.lookup(k, CTX) is not True for k in keys(0, 1))
        finally:
            tier.shutdown()
        capped = make_tier({**valkey_config(server, key_prefix), "max_value_bytes": 1024})
        try:
            assert _store_rows(capped, 1) == [False]
            assert capped.failures["store"] == 1 and "over max_value_bytes (1024)" in caplog.text
        finally:
            capped.shutdown()
    finally:
        server.stop()


def _store_rows(tier, count):
    """Store blocks 0..count-1 from rows of the same numbers, one job each; their successes."""
    for i in range(count):
        tier.submit_store(JobMetadata(i, keys(i), np.array([i]), False, CTX))
    tier.on_schedule_end()
    assert tier.drain(30)
    return [result.success for result in sorted(tier.get_finished(), key=lambda r: r.job_id)]


def test_ttl_sets_an_expiry_that_loads_refresh(valkey_server, key_prefix, engine_factory):
    engine = engine_factory(valkey_config(valkey_server, key_prefix, ttl_s=60))
    engine.store(0, 1, 2, 3)
    engine.store(4)  # 4 primary rows: block 0 is in the tier only now
    name = engine.tier.store.value_name(keys(0)[0])
    admin = valkey_server.admin()
    admin.pexpire(name, 5000)  # as if most of its minute had passed
    assert engine.lookup_until_done(0) == [True]
    assert engine.loaded_bytes(0) == [block_bytes(keys(0)[0], ROW)]
    assert 50_000 < admin.pttl(name) <= 60_000
    # an identity's records are labels a TTL would only lose: stored without an expiry
    engine.manager.reset_cache("step-1")  # lists the version in the records
    engine.manager.on_schedule_end()
    records = engine.tier._records
    deadline = time.monotonic() + 30
    while not admin.exists(records._store.value_name(VERSIONS_KEY)):
        assert time.monotonic() < deadline, "the version was not listed"
        time.sleep(0.01)
    assert admin.pttl(records._store.value_name(VERSIONS_KEY)) == -1  # no expiry
    lease = records.lease
    assert admin.pttl(lease._store.value_name(lease.key)) == -1  # nor the engine's lease


@pytest.mark.parametrize("policy", ["allkeys-lru", "volatile-lru"])
def test_check_warns_of_a_memory_policy_that_evicts_records_and_leases(policy, tmp_path, capsys):
    server = ValkeyServer(settings={"maxmemory-policy": policy})
    server.start()
    try:
        config = tmp_path / "engine.yaml"
        config.write_text(
            f"cpu_bytes_to_use: 1MiB\nsecondary_tiers: [{{type: valkey, addresses: ['{server.address}']}}]\n"
        )
        assert config_main(["check", str(config), "--connect"]) == 0  # a warning: the engine starts
        out = capsys.readouterr().out
        warning = f"tier valkey: warning: {server.address}: maxmemory-policy allkeys-lru evicts keys without an expiry"
        assert (warning in out) == (policy == "allkeys-lru")
        assert ("set ttl_s on the tier and a volatile-lru" in out) == (policy == "allkeys-lru")
    finally:
        server.stop()


# -- faults: a node killed, frozen, failed over ---------------------------------------------

FAST_FAULTS = {"request_timeout_s": 0.5, "connect_timeout_s": 0.5, "op_timeout_s": 2, "failure_threshold": 2}
FAST_FAULTS |= {"backoff_s": 0.2, "max_backoff_s": 0.4}


def wait_healthy(engine, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not engine.tier.health.healthy:
        assert time.monotonic() < deadline, "the tier did not recover"
        engine.settle()
        time.sleep(0.05)


@pytest.mark.parametrize("fault", ["killed", "frozen"])
def test_a_dead_or_frozen_server_turns_into_failed_jobs_then_recovers(fault, engine_factory, key_prefix):
    server = ValkeyServer()
    server.start()
    try:
        engine = engine_factory(valkey_config(server, key_prefix, **FAST_FAULTS), num_blocks=8)
        engine.store(0, 1)
        server.kill() if fault == "killed" else server.freeze()
        try:
            engine.store(2, 3)
            engine.store(4, 5)
            assert not engine.tier.health.healthy
            assert engine.tier.failures["store"] >= 2
            assert engine.tier.lookup(keys(0)[0], CTX) is False  # an unhealthy tier answers misses
        finally:
            server.start() if fault == "killed" else server.thaw()
        wait_healthy(engine)
        engine.store(6, 7)
        assert engine.tier.get_stats()["counters"]["blocks_stored"] == 4
        if fault == "frozen":  # its data survived
            assert engine.tier.lookup(keys(0)[0], CTX) is True
    finally:
        server.stop()


def test_a_cluster_failover_loses_no_byte_and_the_tier_follows_the_new_primary(engine_factory, key_prefix):
    cluster = ValkeyCluster(primaries=3, replicas=1)
    cluster.start()
    try:
        config = {**valkey_config(cluster, key_prefix), **FAST_FAULTS, "failure_threshold": 1000}
        engine = engine_factory({**config, "addresses": cluster.addresses}, num_blocks=8)
        engine.store(*range(8))
        engine.store(*range(8, 16))  # 8 primary rows: blocks 0..7 are in the cluster only
        for node in cluster.primaries:  # every write reached its replica
            node.admin().execute_command("WAIT", 1, 2000)
        victim = cluster.primary_of(engine.tier.store.value_name(keys(0)[0]))
        victim.kill()
        deadline = time.monotonic() + 30
        while not cluster.ok():
            assert time.monotonic() < deadline, "no replica took over"
            time.sleep(0.1)
        assert cluster.primary_of(engine.tier.store.value_name(keys(0)[0])) in cluster.replicas
        loaded = 0
        for i in range(8):
            answer = engine.lookup_until_done(i, steps=40)
            if answer == [True]:
                assert engine.loaded_bytes(i) == [block_bytes(keys(i)[0], ROW)]
                loaded += 1
        assert loaded == 8  # replicated before the failover: nothing lost
        engine.store(*range(16, 24))
        assert engine.tier.get_stats()["counters"]["blocks_stored"] >= 16
    finally:
        cluster.stop()


def test_importing_the_tier_leaves_no_warning_for_module_scans():
    """glide's stand-ins for its old module names warn on any attribute access; scans of
    every module (inspect.getmodule, as torch runs) must not trip them (warnings are errors
    here)."""
    for module in list(sys.modules.values()):
        hasattr(module, "__file__")


@pytest.mark.asyncio
async def test_without_recover_index_a_new_tier_lists_nothing_yet_finds_blocks_by_probes(valkey_server, key_prefix):
    first = ValkeyBlockStore(FINGERPRINT, [valkey_server.address], key_prefix=key_prefix)
    await first.open()
    try:
        await first.put(key(1), memoryview(bytearray(64)))
        assert await first.recover() == [] and await first.exists(key(1))
        await first.remove_namespace()  # lists for itself
        assert not await first.exists(key(1))
    finally:
        await first.close()


def test_a_second_engine_finds_the_first_ones_blocks_by_probes_without_recovery(
    valkey_server, key_prefix, engine_factory
):
    config = valkey_config(valkey_server, key_prefix)
    engine_factory(config).store(0, 1, 2)
    second = engine_factory(config)
    assert len(second.tier.index) == 0  # nothing listed at start
    assert second.lookup_until_done(0, 1, 2, 3, steps=10) == [True, True, True, False]
    assert second.tier.get_stats()["counters"]["lookups_deferred"] >= 4  # each key probed once


@pytest.fixture
def tls_server(valkey_server, tmp_path):
    """The session's server behind a TLS endpoint with a certificate of a test CA; yields
    (address, path of the CA's PEM file)."""
    authority = trustme.CA()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    authority.issue_cert("127.0.0.1").configure_cert(context)
    ca_file = tmp_path / "ca.pem"
    authority.cert_pem.write_to_path(str(ca_file))
    front = TlsFront(valkey_server.port, context)
    front.start()
    yield f"127.0.0.1:{front.port}", ca_file
    front.stop()


def test_tls_verifies_the_server_against_the_given_ca(tls_server, key_prefix, engine_factory, tmp_path):
    address, ca_file = tls_server
    config = {"type": "valkey", "addresses": [address], "key_prefix": key_prefix, "tls": True, "connect_timeout_s": 1}
    engine = engine_factory({**config, "tls_ca_file": str(ca_file)})
    engine.store(0, 1)
    assert engine.tier.get_stats()["counters"]["blocks_stored"] == 2
    other = tmp_path / "other-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(other))
    with pytest.raises(ConnectionError, match=r"cannot connect .*; with tls, also check tls_ca_file"):
        make_tier({**config, "tls_ca_file": str(other)})  # a certificate this CA did not sign


def test_a_frozen_cluster_node_fails_its_blocks_and_the_tier_recovers_when_it_thaws(engine_factory, key_prefix):
    cluster = ValkeyCluster(primaries=3)
    cluster.start()
    try:
        config = {**valkey_config(cluster, key_prefix), **FAST_FAULTS, "addresses": cluster.addresses}
        engine = engine_factory(config, num_blocks=8)
        engine.store(*range(8))
        engine.store(*range(8, 16))  # 8 primary rows: blocks 0..7 are in the cluster only
        frozen = cluster.primary_of(engine.tier.store.value_name(keys(0)[0]))
        on_frozen = {i for i in range(8) if cluster.primary_of(engine.tier.store.value_name(keys(i)[0])) is frozen}
        frozen.freeze()
        try:
            answers = {i: engine.lookup_until_done(i, steps=40) for i in range(8)}
            assert not engine.tier.health.healthy  # its loads time out: the breaker opens
        finally:
            frozen.thaw()
        for i, answer in answers.items():
            if answer == [True]:  # loaded before the breaker opened, from another node
                assert i not in on_frozen
                assert engine.loaded_bytes(i) == [block_bytes(keys(i)[0], ROW)]
        assert engine.tier.failures["load"] > 0
        wait_healthy(engine)
        for i in range(8):
            assert engine.lookup_until_done(i, steps=40) == [True]
            assert engine.loaded_bytes(i) == [block_bytes(keys(i)[0], ROW)]
    finally:
        cluster.stop()
