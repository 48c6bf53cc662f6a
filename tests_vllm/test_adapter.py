"""The adapter's translations, without starting an engine."""

import dataclasses
import typing

import pytest
from vllm.v1.kv_offload.base import LookupResult, ReqContext

from tests.helpers import ManualTier, RegionStandIn, key, keys
from tests_vllm.conftest import offloading_config
from tiering import ConfigError, CPUPrimaryTierOffloadingManager, SecondaryTierFactory, TieringOffloadingManager
from tiering.integrations import VLLM_CONNECTOR, vllm_sizing
from tiering.integrations import vllm as adapter
from tiering.integrations.vllm_config import check_kv_transfer_config
from tiering.integrations.vllm_stats import VllmStats, metric_definitions


def test_the_extra_config_is_validated_like_the_yaml_with_the_same_errors(caplog):
    extra = {"cpu_bytes_to_use": "lots", "secondary_tiers": [{"type": "fs"}]}
    with pytest.raises(ConfigError) as caught:
        adapter.KVTieringOffloadingSpec(offloading_config(extra))
    text = str(caught.value)
    assert "kv_connector_extra_config: secondary_tiers[0].root_dir: required key is missing" in text
    assert "kv_connector_extra_config: cpu_bytes_to_use: expected a size such as 65536, 64KiB or 8GiB" in text
    # vLLM prints ~240 lines of tracebacks around it: one line of the log says it all
    (record,) = [r for r in caplog.records if r.levelname == "ERROR"]
    line = record.getMessage()
    assert "\n" not in line and line.startswith("kv-tiering cannot start, invalid configuration: ")
    assert all(problem in line for problem in caught.value.lines)
    assert "tiering-config check --kv-transfer-config" in line
    # the pre-flight check, without vLLM, finds the same problems
    with pytest.raises(ConfigError) as checked:
        check_kv_transfer_config({**VLLM_CONNECTOR, "kv_connector_extra_config": extra})
    assert checked.value.lines == caught.value.lines


def test_a_config_file_is_shared_with_tiering_bench_and_not_mixed_with_keys(tmp_path):
    path = tmp_path / "engine.yaml"
    path.write_text(f"cpu_bytes_to_use: 1MiB\nsecondary_tiers:\n  - type: file\n    root_dir: {tmp_path / 'kv'}\n")
    spec = adapter.KVTieringOffloadingSpec(offloading_config({"config_file": str(path)}))
    try:
        assert spec.engine.num_blocks == (1 << 20) // (64 << 10)  # rows of 2 GPU blocks of 32 KiB
        assert spec.engine.block_size == 64
        manager = spec.get_manager()
        assert manager.lookup(b"\0" * 12, type("Ctx", (), {"req_id": "r"})()) is LookupResult.MISS
    finally:
        spec.shutdown()
    with pytest.raises(ConfigError, match=r"config_file: give the engine's settings in .*engine.yaml or here"):
        adapter.KVTieringOffloadingSpec(offloading_config({"config_file": str(path), "eviction_policy": "arc"}))


def test_groups_of_another_kind_or_block_size_and_unknown_versions_are_refused_at_start():
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

    from tiering.integrations.vllm_connector import check_group_kinds

    config = offloading_config({"cpu_bytes_to_use": "1MiB"}, groups=2)
    spec = adapter.KVTieringOffloadingSpec(config)  # two groups of one block size: a hybrid model
    spec.shutdown()
    odd = dataclasses.replace(
        config, groups=(config.groups[0], dataclasses.replace(config.groups[1], tokens_per_block=64))
    )
    with pytest.raises(ValueError, match=r"groups have \[32, 64\] tokens per block \(a Mamba or linear-attention"):
        adapter.KVTieringOffloadingSpec(odd)
    attention = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    mamba = MambaSpec(block_size=32, shapes=((4, 8),), dtypes=(torch.float32,))
    groups = [KVCacheGroupSpec(["layers.0.attn"], attention), KVCacheGroupSpec(["layers.1.mixer"], mamba)]
    check_group_kinds(KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups[:1]))
    with pytest.raises(ValueError, match=r"^KVTieringConnector cannot offload KV-cache group 1 of kind MambaSpec \("):
        check_group_kinds(KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups))
    with pytest.raises(RuntimeError, match=r"supports vLLM 0.32.x and 0.33.x; this is vLLM 0.34.1"):
        adapter.check_version("0.34.1")
    adapter.check_version("0.33.0+cpu")


def test_a_block_being_written_is_a_pending_hit_and_an_unsure_tier_a_retry():
    """vLLM's own managers answer HIT_PENDING for a block whose primary write is in flight
    (a GPU store, or a promotion just started) and RETRY when a secondary tier is unsure."""
    tier = ManualTier()
    tier.present.update({key(1): True, key(2): None})
    primary = CPUPrimaryTierOffloadingManager(4, RegionStandIn(4))
    manager = adapter._Manager(TieringOffloadingManager(primary, [tier]), spec=None)
    context = ReqContext("r")
    out = manager.prepare_store([key(0)], context)
    answers = [manager.lookup(k, context) for k in keys(0, 1, 2, 3)]
    assert answers == [LookupResult.HIT_PENDING, LookupResult.HIT_PENDING, LookupResult.RETRY, LookupResult.MISS]
    manager.complete_store(out.keys_to_store, context)
    assert manager.lookup(key(0), context) is LookupResult.HIT


def test_refusals_reach_vllm_by_tier_and_reason():
    primary = CPUPrimaryTierOffloadingManager(2, RegionStandIn(2))
    manager = TieringOffloadingManager(primary, [])
    stats = VllmStats(manager, interval_s=0)
    context = ReqContext("r")
    manager.prepare_store(keys(0, 1), context)  # both rows in flight
    assert manager.prepare_store(keys(2), context) is None
    assert manager.prepare_store(keys(3, 4, 5), context) is None
    refused = {name: count for name, count in stats.take().reduce().items() if "refused" in name}
    assert refused == {
        "vllm:kv_tiering_stores_refused:('cpu', 'rows_in_flight')": 1,
        "vllm:kv_tiering_stores_refused:('cpu', 'larger_than_tier')": 1,
    }
    assert manager.prepare_store(keys(2), context) is None
    assert stats.take().reduce() == {"vllm:kv_tiering_stores_refused:('cpu', 'rows_in_flight')": 1}
    definitions = metric_definitions()
    assert definitions["vllm:kv_tiering_stores_refused"].labelnames == ("tier", "reason")
    assert definitions["vllm:kv_tiering_hit_blocks"].labelnames == ("tier",)


def test_a_cpu_tier_too_small_for_two_steps_is_named_once_at_start(caplog):
    config = offloading_config({"cpu_bytes_to_use": "1MiB"}, engine_id=f"size-check-{id(caplog)}")
    spec = adapter.KVTieringOffloadingSpec(config)  # 16 rows of 64 tokens (64 KiB each)
    try:
        assert vllm_sizing.rows_for_two_steps(512, 64) == 16
        vllm_sizing.check_cpu_tier_size(spec.engine, 512)  # fits: said nothing
        assert not caplog.records
        spec2 = adapter.KVTieringOffloadingSpec(offloading_config({"cpu_bytes_to_use": "1MiB"}, engine_id="other"))
        try:
            vllm_sizing.check_cpu_tier_size(spec2.engine, 520)  # 9 rows a step
            vllm_sizing.check_cpu_tier_size(spec2.engine, 520)
        finally:
            spec2.shutdown()
        (line,) = [record.getMessage() for record in caplog.records]
        assert "the CPU tier (cpu_bytes_to_use=1048576: 16 rows of 64 tokens)" in line
        assert "max_num_batched_tokens=520 (18 rows" in line and "cpu_bytes_to_use=1179648 or more fits" in line
    finally:
        spec.shutdown()


def test_a_promoted_blocks_source_follows_its_tiers_type_not_its_name():
    """vLLM's ``cache hit source``: a file tier named 'nvme' is disk, an S3 tier named
    'file-cold' is unspecified, a block stored from the GPU is host."""
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    file_tier, s3_tier = ManualTier("file"), ManualTier("s3")
    file_tier.name, s3_tier.name = "nvme", "file-cold"
    file_tier.present[key(1)] = True
    s3_tier.present[key(2)] = True
    primary = CPUPrimaryTierOffloadingManager(4, RegionStandIn(4))
    manager = adapter._Manager(TieringOffloadingManager(primary, [file_tier, s3_tier]), spec=None)
    context = ReqContext("r")
    out = manager.prepare_store([key(0)], context)
    manager.complete_store(out.keys_to_store, context)
    assert [manager.lookup(k, context) for k in keys(1, 2)] == [LookupResult.HIT_PENDING] * 2  # promotions queued
    manager.manager.on_schedule_end()
    file_tier.finish_all()
    s3_tier.finish_all()
    manager.manager.on_schedule_end()
    sources = [manager.get_load_source(k, context) for k in keys(0, 1, 2)]
    assert sources == [CacheHitSource.HOST, CacheHitSource.DISK, CacheHitSource.EXTERNAL_UNSPECIFIED]


def test_the_refusal_metrics_name_every_reason_the_engine_counts():
    from tiering.cpu.refusals import REFUSAL_REASONS

    definitions = metric_definitions()
    for name in ("vllm:kv_tiering_stores_refused", "vllm:kv_tiering_promotions_refused"):
        assert all(reason in definitions[name].documentation for reason in REFUSAL_REASONS), name


@pytest.mark.parametrize(
    ("window", "extra", "asked", "needed"), [(64, 0, 2, 2), (65, 0, 3, 2), (97, 0, 4, 3), (65, 32, 3, 3)]
)
def test_a_sliding_window_hit_asks_for_the_blocks_vllms_own_cache_keeps(window, extra, asked, needed):
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import get_sliding_window_size_in_chunks
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from tiering.integrations.vllm_connector import hit_window

    class Group(typing.NamedTuple):  # the fields of vLLM's GroupOffloadConfig that hit_window reads
        kv_cache_spec: object
        tokens_per_chunk: int
        sliding_window_size_in_chunks: int | None

    shape = {"num_kv_heads": 2, "head_size": 32, "dtype": torch.float32}
    spec = SlidingWindowSpec(32, sliding_window=window, extra_retained_tokens=extra, **shape)
    assert get_sliding_window_size_in_chunks(spec, 32) == asked  # what vLLM's offloading scheduler asks for
    assert hit_window(Group(spec, 32, asked)).sliding_window_size_in_chunks == needed
    full = Group(FullAttentionSpec(32, **shape), 32, None)
    assert hit_window(full) is full


def test_events_reach_vllm_with_their_medium_locality_and_owner():
    """vLLM's events carry where a block is (`Locality`) and which tier holds it (its owner):
    routers score a replica by them, and vLLM's tracker keeps a block's metadata until the
    removal each secondary tier promises (`removal_expected`)."""
    from vllm.v1.kv_offload.base import Locality, Medium

    primary = CPUPrimaryTierOffloadingManager(4, RegionStandIn(4), enable_events=True)
    tier = SecondaryTierFactory.create_secondary_tier({"type": "memory"}, primary.get_kv_memoryview(), None)
    manager = adapter._Manager(TieringOffloadingManager(primary, [tier], enable_events=True), spec=None)
    context = ReqContext("r")
    out = manager.prepare_store(keys(0, 1), context)
    manager.complete_store(out.keys_to_store, context)
    events: list = []
    try:
        while not any(event.medium is Medium.STORAGE for event in events):  # the cascade lands (the test's timeout)
            manager.on_schedule_end()
            assert tier.drain(10)
            events += manager.take_events()
    finally:
        manager.manager.shutdown()
    described = {(e.medium, e.locality, e.ownership, e.removed, e.removal_expected) for e in events}
    assert (Medium.CPU, Locality.LOCAL, None, False, False) in described
    assert (Medium.STORAGE, Locality.LOCAL, "memory", False, True) in described


def test_the_mediums_and_localities_a_tier_may_declare_are_vllms_and_reach_its_events_as_named():
    """`tiering.engine.load_tiers` refuses any other at build: each becomes vLLM's enum member of
    that name, and the event its publisher sends carries the same string (a router matches them)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import _MEDIUM_TO_EVENT_STR
    from vllm.v1.kv_offload.base import Locality, Medium

    from tiering.engine.load_tiers import LOCALITIES, MEDIUMS

    assert {_MEDIUM_TO_EVENT_STR[Medium[medium]] for medium in MEDIUMS} == set(MEDIUMS)
    assert {Locality(locality).value for locality in LOCALITIES} == {locality.value for locality in Locality}
