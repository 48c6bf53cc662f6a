"""The S3 store and tier against a real S3-compatible server (moto) on 127.0.0.1."""

import os
import signal
import socket
import time

import pytest

from tests.helpers import CTX, ROW, RegionStandIn, block_bytes, key, keys
from tiering import ConfigError, SecondaryTierFactory, parse_config
from tiering.backends.s3 import S3BlockStore
from tiering.testing import BlockStoreSuite, StoreKit
from tiering.testing.block_store import FINGERPRINT, opened
from tiering.testing.processes import free_port
from tiering.testing.s3_server import MotoServer


@pytest.fixture
def store_kit(s3_server, s3_bucket):
    client = s3_server.client()

    def read_raw(store, key):
        return client.get_object(Bucket=s3_bucket, Key=store.object_name(key))["Body"].read()

    def write_raw(store, key, raw):
        client.put_object(Bucket=s3_bucket, Key=store.object_name(key), Body=raw)

    return StoreKit(
        make=lambda fingerprint: S3BlockStore(
            fingerprint, s3_bucket, prefix="cache/", endpoint_url=s3_server.endpoint_url, max_attempts=1
        ),
        read_raw=read_raw,
        write_raw=write_raw,
    )


class TestBlockStoreConformance(BlockStoreSuite):
    """Every test of `tiering.testing.BlockStoreSuite`, on this store."""


def s3_config(server, bucket, **extra):
    return {"type": "s3", "bucket": bucket, "endpoint_url": server.endpoint_url, "prefix": "kv/", **extra}


@pytest.mark.asyncio
async def test_objects_live_under_prefix_and_layout(store_kit, s3_server, s3_bucket):
    store = await opened(store_kit)
    try:
        await store.put(key(1), memoryview(bytearray(64)))
        listed = s3_server.client().list_objects_v2(Bucket=s3_bucket)["Contents"]
        assert [obj["Key"] for obj in listed] == [f"cache/{FINGERPRINT.hex()}/{key(1).hex()}"]
    finally:
        await store.close()


@pytest.mark.asyncio
async def test_missing_bucket_is_a_clear_error_unless_created(s3_server, s3_bucket):
    store = S3BlockStore(FINGERPRINT, "no-such-bucket-here", endpoint_url=s3_server.endpoint_url)
    with pytest.raises(FileNotFoundError, match=r"'no-such-bucket-here' .* does not exist; create it or set"):
        await store.open()
    created = S3BlockStore(FINGERPRINT, "created-by-the-tier", endpoint_url=s3_server.endpoint_url, create_bucket=True)
    await created.open()
    await created.close()


@pytest.mark.asyncio
async def test_unreachable_endpoint_is_a_clear_error(s3_environment):
    url = f"http://127.0.0.1:{free_port()}"
    store = S3BlockStore(FINGERPRINT, "any-bucket", endpoint_url=url, max_attempts=1, connect_timeout_s=0.5)
    with pytest.raises(ConnectionError, match="cannot reach the endpoint"):
        await store.open()


def make_s3_tier(config):
    return SecondaryTierFactory.create_secondary_tier(config, RegionStandIn(4, ROW).create_kv_memoryview(), None)


def test_an_endpoint_that_never_answers_fails_construction_in_bounded_time_naming_it(s3_environment):
    with socket.socket() as silent:  # accepts connections (the backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        config = {"type": "s3", "bucket": "b", "endpoint_url": url, "read_timeout_s": 0.5, "connect_timeout_s": 0.5}
        with pytest.raises(ConnectionError, match=f"bucket 'b' at {url}: cannot reach the endpoint .*timeout"):
            make_s3_tier(config)  # 2 attempts of 0.5 s, where open_timeout_s would be 120 s


@pytest.mark.parametrize("bucket", ["Bad Bucket!", "", "a/b", "x" * 256])
def test_a_bucket_name_the_client_would_refuse_fails_at_config_load_naming_the_key(bucket):
    text = f"cpu_bytes_to_use: 1MiB\nsecondary_tiers: [{{type: s3, bucket: '{bucket}'}}]\n"
    with pytest.raises(ConfigError, match=r"e.yaml: secondary_tiers\[0\].bucket: '.*' is not a bucket name"):
        parse_config(text, "e.yaml")
    parse_config(text.replace(bucket or "''", "legacy_Bucket.name-1"), "e.yaml")  # what the S3 client sends


def test_client_timeouts_must_be_below_the_operation_timeout(s3_environment):
    with pytest.raises(ValueError, match=r"read_timeout_s \(30.0\) must be below op_timeout_s \(20.0\)"):
        make_s3_tier({"type": "s3", "bucket": "b", "read_timeout_s": 30, "op_timeout_s": 20})


def test_a_frozen_endpoint_fails_requests_and_trips_the_breaker_within_the_client_timeouts(
    engine_factory, s3_environment, caplog
):
    server = MotoServer()
    server.start()
    try:
        server.create_bucket("frozen")
        # op_timeout_s far beyond the test's own timeout: only the client's timeouts can end it.
        config = s3_config(
            server, "frozen", read_timeout_s=0.5, connect_timeout_s=0.5, failure_threshold=2, op_timeout_s=600
        )
        engine = engine_factory(config, num_blocks=8)
        engine.store(0, 1)
        os.kill(server.pid, signal.SIGSTOP)  # alive, listening, silent
        try:
            out = engine.manager.prepare_store(keys(2, 3), CTX)
            engine.manager.complete_store(out.keys_to_store, CTX)
            engine.manager.on_schedule_end()
            assert engine.tier.drain(50)
            engine.manager.on_schedule_end()
        finally:
            os.kill(server.pid, signal.SIGCONT)
        assert engine.tier.failures["store"] == 2 and not engine.tier.health.healthy
        assert "ReadTimeoutError" in caplog.text
    finally:
        server.stop()


@pytest.mark.asyncio
async def test_no_credentials_is_a_clear_error(s3_server, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    store = S3BlockStore(FINGERPRINT, "any-bucket", endpoint_url=s3_server.endpoint_url, max_attempts=1)
    with pytest.raises(PermissionError, match="no credentials in the AWS chain"):
        await store.open()


def test_secrets_never_appear_in_reprs_or_logs(s3_server, s3_bucket, s3_environment, engine_factory, caplog):
    engine = engine_factory(s3_config(s3_server, s3_bucket))
    engine.store(0)
    secret, key_id = s3_environment["AWS_SECRET_ACCESS_KEY"], s3_environment["AWS_ACCESS_KEY_ID"]
    for text in (repr(engine.tier), repr(engine.tier.store), str(vars(engine.tier.store)), caplog.text):
        assert secret not in text and key_id not in text


def test_round_trip_through_the_manager(s3_server, s3_bucket, engine_factory):
    engine = engine_factory(s3_config(s3_server, s3_bucket))
    engine.store(0, 1, 2, 3)
    engine.store(4, 5, 6, 7)  # evicts 0..3 from the primary tier
    engine.rows[:] = 0
    assert engine.lookup_until_done(0, 1, 2, 3) == [True] * 4
    assert engine.loaded_bytes(0, 1, 2, 3) == [block_bytes(k, ROW) for k in keys(0, 1, 2, 3)]


def test_objects_archived_by_a_lifecycle_rule_are_dropped_without_opening_the_breaker(
    s3_server, s3_bucket, engine_factory
):
    """A GET of an object moved to Glacier answers InvalidObjectState, forever: each such
    object is one failed promotion, dropped and deleted; the tier stays healthy."""
    engine = engine_factory(s3_config(s3_server, s3_bucket))
    engine.store(*range(4))
    engine.store(*range(4, 8))  # 0..3 now only in S3
    client = s3_server.client()
    for i in range(4):
        name = engine.tier.store.object_name(key(i))
        body = client.get_object(Bucket=s3_bucket, Key=name)["Body"].read()
        client.put_object(Bucket=s3_bucket, Key=name, Body=body, StorageClass="GLACIER")
    with pytest.raises(client.exceptions.ClientError, match="InvalidObjectState"):
        client.get_object(Bucket=s3_bucket, Key=engine.tier.store.object_name(key(0)))
    engine.rows[:] = 0
    for _ in range(2):  # more failures than the breaker's threshold, had they counted
        for i in range(4):
            assert engine.lookup_until_done(i) == [False]
    assert engine.tier.failures["load_unusable"] == 4 and engine.tier.health.healthy
    assert all(engine.tier.lookup(key(i), CTX) is False for i in range(4))  # dropped from the index
    engine.store(8, 9, 10, 11)
    engine.store(4, 5, 6, 7)  # the tier still stores and loads
    assert engine.lookup_until_done(8, 9) == [True, True]
    assert engine.loaded_bytes(8, 9) == [block_bytes(k, ROW) for k in keys(8, 9)]
    listed = client.list_objects_v2(Bucket=s3_bucket).get("Contents", [])
    assert not {engine.tier.store.object_name(key(i)) for i in range(4)} & {o["Key"] for o in listed}  # deleted


def test_a_second_engine_on_the_bucket_sees_what_the_first_wrote(s3_server, s3_bucket, engine_factory):
    early = engine_factory(s3_config(s3_server, s3_bucket))  # started before anything was written
    writer = engine_factory(s3_config(s3_server, s3_bucket))
    writer.store(0, 1)
    late = engine_factory(s3_config(s3_server, s3_bucket))  # started after: finds them in the listing
    assert len(late.tier.index) == 2
    assert late.lookup_until_done(0, 1) == [True, True]
    assert early.tier.lookup(key(0), CTX) is None  # unknown: probed once
    assert early.lookup_until_done(0, 1, 9) == [True, True, False]
    assert early.loaded_bytes(0, 1) == [block_bytes(k, ROW) for k in keys(0, 1)]


def test_an_outage_fails_jobs_and_lookups_then_the_tier_recovers(engine_factory, s3_environment, caplog):
    server = MotoServer()
    server.start()
    try:
        server.create_bucket("outage")
        config = s3_config(
            server,
            "outage",
            max_attempts=1,
            connect_timeout_s=0.5,
            read_timeout_s=2,
            failure_threshold=2,
            backoff_s=0.2,
        )
        engine = engine_factory(config, num_blocks=8, reset_scope="cpu")  # resets keep S3's blocks
        engine.store(0, 1)
        server.stop()
        out = engine.manager.prepare_store(keys(2, 3), CTX)
        engine.manager.complete_store(out.keys_to_store, CTX)
        engine.settle()  # both blocks fail: the breaker trips
        assert engine.tier.failures["store"] == 2
        assert not engine.tier.health.healthy
        assert engine.tier.lookup(key(0), CTX) is False  # misses while unhealthy
        assert engine.tier.lookup(key(2), CTX) is False
        server.start()  # the server is back, empty
        server.create_bucket("outage")
        time.sleep(0.3)
        engine.settle()  # the backoff has passed: the probe succeeds
        engine.settle()
        assert engine.tier.health.healthy
        engine.store(4, 5)
        assert engine.tier.lookup(key(4), CTX) is True
        engine.store(6, 7)
        engine.manager.reset_cache()  # the primary forgets; blocks must come from S3
        engine.rows[:] = 0
        assert engine.lookup_until_done(0, 4, 5) == [False, True, True]  # 0 was lost with the server
        assert engine.loaded_bytes(4, 5) == [block_bytes(k, ROW) for k in keys(4, 5)]
    finally:
        server.stop()
    assert "unhealthy" in caplog.text and "recovered" in caplog.text


@pytest.mark.asyncio
async def test_recovery_reads_every_page_of_the_listing(s3_server, s3_bucket):
    def make():
        return S3BlockStore(FINGERPRINT, s3_bucket, endpoint_url=s3_server.endpoint_url, list_page_size=2)

    writer = make()
    await writer.open()
    for i in range(5):
        await writer.put(key(i), memoryview(bytearray(100)))
    s3_server.client().put_object(Bucket=s3_bucket, Key=f"{FINGERPRINT.hex()}/not-hex", Body=b"x")
    await writer.close()
    reader = make()
    await reader.open()
    try:
        assert sorted(k for k, _ in await reader.recover()) == keys(0, 1, 2, 3, 4)
    finally:
        await reader.close()


def test_an_s3_tiers_index_is_bounded_by_default_and_forgets_without_deleting(s3_server, s3_bucket, engine_factory):
    engine = engine_factory(s3_config(s3_server, s3_bucket))
    assert engine.tier.settings.index_max_blocks == 1 << 20  # was unbounded: every listed key and probe hit
    bounded = engine_factory({**s3_config(s3_server, s3_bucket), "index_max_blocks": 1})
    bounded.store(0)
    bounded.store(1)
    assert len(bounded.tier.index) == 1 and bounded.tier.get_stats()["counters"]["index_forgotten"] == 1
    assert bounded.lookup_until_done(0, 1) == [True, True]  # the forgotten one is found again by a probe


def test_the_s3_server_command_serves_a_bucket_and_prints_its_endpoint_until_stopped():
    """`python -m tiering.testing.s3_server` exited 0 at once, printing nothing."""
    import subprocess
    import sys

    import botocore.session

    command = [sys.executable, "-m", "tiering.testing.s3_server", "--bucket", "from-the-command"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = server.stdout.readline()  # waits for the fact: the server is up, with its bucket
        assert line.startswith("s3 server up: http://127.0.0.1:"), line
        endpoint = line.split()[3].rstrip(";")
        assert "tier: {type: s3, bucket: from-the-command, endpoint_url: " + endpoint + "}" in line
        client = botocore.session.get_session().create_client(
            "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x"
        )
        assert [b["Name"] for b in client.list_buckets()["Buckets"]] == ["from-the-command"]
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(60) == 0
        server.stdout.close()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", int(endpoint.rsplit(":", 1)[1])), timeout=1).close()
