"""Tenants' shares of the CPU tier: who is evicted for whom, counters, config."""

import hashlib
import re

import numpy as np
import pytest

from tests.helpers import ROW as HELPER_ROW
from tests.helpers import block_bytes, keys, metrics_text
from tiering import ConfigError, CPUOffloadingManager, ReqContext, make_offload_key
from tiering.config import parse_config
from tiering.cpu.tenants import TenantsConfig, TenantShares

ROW = 4096


def manager(num_blocks=8, policy="lru", retention=0.0, **tenants):
    """A CPU tier of `num_blocks` rows with `tenants` (``off=True``: none) whose requests'
    retention hints may hold `retention` of each tenant's share."""
    shares = None
    if not tenants.get("off"):
        shares = TenantShares(TenantsConfig(**tenants), num_blocks, ROW, policy, retention)
    return CPUOffloadingManager(num_blocks, policy, tenants=shares)


def ctx(tenant, req="r", hint=None):
    return ReqContext(
        f"{req}-{tenant}", tenant=tenant, kv_transfer_params=None if hint is None else {"kv_tiering": hint}
    )


def store(cpu, tenant, *ids, hint=None, req="r"):
    """Tenant `tenant`'s request `req` stores `ids`; with a `hint`, it finishes with it."""
    request = ctx(tenant, req, hint)
    out = cpu.prepare_store(keys(*ids), request)
    if out is not None:
        cpu.complete_store(out.keys_to_store, request)
    if hint is not None:
        cpu.on_request_finished(request)
    return out


def resident(cpu, *ids):
    return [cpu.lookup(key, ReqContext("check")) for key in keys(*ids)]


@pytest.mark.parametrize("policy", ["lru", "arc", "arc-s"])
def test_a_tenant_within_its_share_is_never_evicted_for_one_beyond_it(policy):
    cpu = manager(policy=policy, default_share=0.5)
    store(cpu, "chat", 0, 1, 2, 3)  # its share: 4 rows
    for start in range(100, 140, 4):  # a flood of unique prompts from another tenant
        assert store(cpu, "flood", *range(start, start + 4)) is not None  # it evicts its own
    assert resident(cpu, 0, 1, 2, 3) == [True] * 4
    assert cpu.tenants.held == {"chat": 4, "flood": 4}


@pytest.mark.parametrize("policy", ["lru", "arc", "arc-s"])
def test_a_tenants_hints_hold_within_its_own_share(policy):
    cpu = manager(policy=policy, retention=0.5, default_share=0.5)  # 4 rows each; 2 may be retained
    store(cpu, "chat", 0, 1, hint={"retain": "1h"}, req="a")
    store(cpu, "chat", 2, 3, hint={"release": True}, req="b")
    store(cpu, "flood", *range(100, 104))
    store(cpu, "chat", 4, 5, req="c")  # within its share: evicts its own, released first
    assert resident(cpu, 0, 1, 2, 3, 4, 5) == [True, True, False, False, True, True]
    store(cpu, "chat", 6, 7, req="d")  # then the unretained ones, least recent first
    assert resident(cpu, 0, 1, 4, 5, 6, 7) == [True, True, False, False, True, True]
    store(cpu, "chat", 8, 9, 10, req="e")  # 6 and 7, then one deadline gives way
    assert resident(cpu, 0, 1).count(True) == 1 and resident(cpu, 6, 7, 8, 9, 10) == [False] * 2 + [True] * 3
    stats = cpu.get_stats()
    assert stats["counters"]["retentions"] == 2 and stats["counters"]["retentions_released"] == 2
    assert stats["counters"]["retentions_dropped"] == 1 and stats["gauges"]["retained_blocks"] == 1
    assert resident(cpu, *range(100, 104)) == [True] * 4  # the other tenant lost nothing


def test_a_tenants_retention_is_capped_by_its_own_share():
    cpu = manager(retention=0.5, default_share=0.5, quotas={"big": 0.75})  # chat may retain 2, big 3
    store(cpu, "chat", 0, 1, 2, hint={"retain": "1h"})
    store(cpu, "big", 10, 11, 12, hint={"retain": "1h"})
    assert cpu.get_stats()["gauges"]["retained_blocks"] == 5
    assert cpu.get_stats()["counters"]["retentions_dropped"] == 1  # chat's third


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_without_shares_the_flood_evicts_everyone(policy):
    cpu = manager(policy=policy, off=True)
    store(cpu, "chat", 0, 1, 2, 3)
    for start in range(100, 140, 4):
        store(cpu, "flood", *range(start, start + 4))
    assert resident(cpu, 0, 1, 2, 3) == [False] * 4


def test_tenants_over_their_share_are_evicted_first_even_when_more_recent():
    cpu = manager(default_share=0.5)
    store(cpu, "chat", 0)  # the least recent block
    store(cpu, "flood", *range(100, 107))  # 7 rows: over its share of 4, nobody needed them
    store(cpu, "chat", 1, 2)  # within its share: takes from the tenant over its share
    assert resident(cpu, 0, 1, 2) == [True] * 3
    assert resident(cpu, 100, 101) == [False, False] and cpu.tenants.held == {"chat": 3, "flood": 5}


def test_unused_share_serves_others_until_its_tenant_needs_it():
    cpu = manager(quotas={"chat": 0.75}, default_share=0.25)
    store(cpu, "flood", *range(100, 108))  # the whole tier while chat needs nothing
    assert cpu.tenants.held["flood"] == 8
    store(cpu, "chat", *range(6))
    assert cpu.tenants.held == {"flood": 2, "chat": 6}


def test_a_tenant_beyond_its_share_with_no_idle_row_of_its_own_is_refused_by_reason(caplog):
    cpu = manager(default_share=0.5)
    store(cpu, "chat", 0, 1, 2, 3)
    store(cpu, "flood", 100, 101, 102, 103)
    cpu.prepare_load(keys(100, 101, 102, 103), ctx("flood"))  # every row of its own is busy
    assert store(cpu, "flood", 200) is None
    assert resident(cpu, 0, 1, 2, 3) == [True] * 4
    assert cpu.get_stats()["counters"]["stores_refused"]["tenant_share"] == 1
    assert store(cpu, "chat", 4) is not None  # chat, at its share, makes room from its own blocks


def test_shares_in_bytes_and_requests_without_a_tenant_go_to_the_default():
    cpu = manager(default_tenant="anon", default_share=2 * ROW, quotas={"chat": "16KiB"})
    assert (cpu.tenants.share("chat"), cpu.tenants.share("anon"), cpu.tenants.share("x")) == (4, 2, 2)
    out = cpu.prepare_store(keys(1), ReqContext("no-tenant"))
    cpu.complete_store(out.keys_to_store, ReqContext("no-tenant"))
    assert cpu.tenants.held == {"anon": 1}


def test_a_tenant_name_too_long_counts_as_other_logged_once(caplog):
    cpu = manager(num_blocks=8)
    long = "s" * 1_000_000  # a client's cache_salt: a dict key and a metric label
    store(cpu, long, 1)
    store(cpu, long + "2", 2)
    store(cpu, "s" * 256, 3)  # the longest name kept
    assert cpu.tenants.held == {"other": 2, "s" * 256: 1}
    assert caplog.text.count("tenant name of") == 1 and max(map(len, caplog.text.splitlines())) < 300


def test_counters_by_tenant_name_the_most_active_and_sum_the_rest_as_other():
    cpu = manager(metric_tenants=1, num_blocks=16)
    for tenant, ids in (("a", (0, 1, 2)), ("b", (10,)), ("c", (20,))):
        store(cpu, tenant, *ids)
        for key in keys(*ids, 99):
            cpu.lookup(key, ctx(tenant))
    stats = cpu.tenants.stats()
    assert set(stats) == {"a", "other"}
    assert stats["a"]["counters"] == {"hits": 3, "misses": 1, "blocks_stored": 3, "bytes_stored": 3 * ROW}
    assert stats["other"]["counters"]["hits"] == 2 and stats["other"]["gauges"]["blocks"] == 2


def test_a_failed_store_and_a_reset_give_the_rows_back_to_no_one():
    cpu = manager()
    out = cpu.prepare_store(keys(1, 2), ctx("a"))
    cpu.complete_store(out.keys_to_store, ctx("a"), success=False)
    assert cpu.tenants.held["a"] == 0
    store(cpu, "a", 3)
    cpu.reset_cache()
    assert cpu.tenants.held["a"] == 0 and not cpu.tenants.owner


def test_tenant_metrics_carry_a_tenant_label(tmp_path):
    from tests.helpers import Engine

    engine = Engine({"type": "memory"}, tenants=TenantsConfig())
    try:
        engine.manager.prepare_store(keys(1), ctx("acme"))
        engine.manager.lookup(keys(2)[0], ctx("acme"))
        text = metrics_text(engine.manager)
    finally:
        engine.close()
    assert 'tiering_tenant_misses_total{tenant="acme"} 1.0' in text
    assert 'tiering_tenant_blocks{tenant="acme"} 1.0' in text


@pytest.mark.parametrize(
    ("tenants", "message"),
    [
        ("{default_share: 0}", "tenants.default_share: expected a fraction of the tier (0 < x <= 1) or bytes"),
        ("{quotas: {chat: lots}}", "tenants.quotas.chat: expected a fraction of the tier"),
        ("{quota: {}}", "tenants.quota: unknown key"),
        ("{metric_tenants: 0}", "tenants.metric_tenants: Input should be greater than or equal to 1"),
    ],
)
def test_bad_tenant_configs_name_the_key(tenants, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(f"cpu_bytes_to_use: 1GiB\ntenants: {tenants}")


def tier_config(kind, request, tmp_path):
    """A tier config of `kind`: one engine's own (memory) or shared by engines (the rest)."""
    if kind == "memory":
        return {"type": "memory"}
    if kind == "file":
        return {"type": "file", "root_dir": str(tmp_path / "shared"), "layout": "files", "probe_misses": True}
    if kind == "s3":
        server, bucket = request.getfixturevalue("s3_server"), request.getfixturevalue("s3_bucket")
        return {"type": "s3", "bucket": bucket, "endpoint_url": server.endpoint_url}
    from tests.test_valkey_store import valkey_config

    return valkey_config(request.getfixturevalue("valkey_server"), request.getfixturevalue("key_prefix"))


def tenant_keys(tenant, *ids):
    """Keys of block ids `ids` of a request of `tenant`: vLLM mixes a request's cache_salt into
    its block hashes, so the same tokens of two tenants never share a key."""
    salted = (hashlib.blake2b(i.to_bytes(8, "big"), digest_size=16, key=tenant.encode()).digest() for i in ids)
    return [make_offload_key(block_hash, 0) for block_hash in salted]


def store_as(engine, tenant, ids):
    out = engine.manager.prepare_store(tenant_keys(tenant, *ids), ctx(tenant))
    for k, row in zip(out.keys_to_store, out.store_spec.block_ids, strict=True):
        engine.rows[row] = np.frombuffer(block_bytes(k, HELPER_ROW), dtype=engine.rows.dtype)
    engine.manager.complete_store(out.keys_to_store, ctx(tenant))
    engine.settle()


def lookups_until_done(engine, tenant, ids, steps=10):
    for _ in range(steps):
        answers = [engine.manager.lookup(k, ctx(tenant)) for k in tenant_keys(tenant, *ids)]
        engine.settle()
        if None not in answers:
            return answers
    raise AssertionError("still in flight")


@pytest.mark.parametrize("kind", ["memory", "file", "s3", "valkey"])
def test_tenants_with_the_same_tokens_never_share_a_key_in_any_tier_or_probe(kind, request, tmp_path, engine_factory):
    config = tier_config(kind, request, tmp_path)
    engine = engine_factory(config)
    store_as(engine, "acme", [0, 1, 2, 3])  # the same block ids (tokens) for both tenants
    store_as(engine, "acme", [4, 5, 6, 7])  # the first four leave the CPU tier: only the tier has them
    readers = [engine] if kind == "memory" else [engine, engine_factory(config)]  # and an engine that probes
    for reader in readers:
        assert lookups_until_done(reader, "globex", [0, 1, 2, 3]) == [False] * 4
        assert lookups_until_done(reader, "acme", [0, 1, 2, 3]) == [True] * 4


@pytest.mark.parametrize("policy", ["lru", "arc-s"])
def test_a_hundred_thousand_salts_keep_the_tenants_state_bounded_and_the_named_tenants_served(policy):
    """Under vLLM any API client names its tenant (its cache_salt): state must not grow with them."""
    cpu = manager(num_blocks=64, policy=policy, default_share=0.25, quotas={"chat": 0.5}, max_tenants=16)
    store(cpu, "chat", 0, 1, 2, 3)
    for salt in range(100_000):
        request = ctx(f"salt-{salt}")
        cpu.lookup(keys(1000 + salt)[0], request)
        if salt % 100 == 0:  # some of them store a block too
            store(cpu, f"salt-{salt}", 1000 + salt)
    tenants = cpu.tenants
    assert len(tenants.counters) <= 16 + 2  # the tracked ones, "chat" (a quota) and "other"
    assert len(tenants._policies) <= 16 + 2 and len(tenants._idle) <= 16
    assert resident(cpu, 0, 1, 2, 3) == [True] * 4  # a named tenant within its share kept its blocks
    stats = tenants.stats()
    assert len(stats) <= 8 + 1 and stats["chat"]["gauges"]["blocks"] == 4
    assert sum(part["counters"]["misses"] for part in stats.values()) == 100_000  # nothing lost in "other"
    assert sum(part["gauges"]["blocks"] for part in stats.values()) == len(cpu.tenants.owner) <= 64
