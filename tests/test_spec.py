import os
import threading

import numpy as np
import pytest
import torch

from tests.helpers import keys, region_name
from tiering import (
    ConfigError,
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    KVLayout,
    ReqContext,
    TieringOffloadingSpec,
    canonicalize_kv_caches,
    parse_config,
)
from tiering.contract.identity import CHECKPOINT, namespace
from tiering.cpu.shared_region import region_path
from tiering.tiers.blockstore.generations import record_namespace
from tiering.tiers.blockstore.leases import lease_namespace


def instance() -> str:
    return region_name()


def test_sizing_from_a_model_preset():
    layout = KVLayout.from_preset("llama-3.1-8b", gpu_block_size=16, world_size=2)
    assert layout.kv_bytes_per_token == 32 * 2 * 8 * 128 * 2  # layers x (K, V) x heads x dim x bf16 = 128 KiB
    spec = TieringOffloadingSpec(parse_config("cpu_bytes_to_use: 8GiB\nblock_size: 256"), layout, instance())
    assert spec.bytes_per_block == 256 * 128 * 1024 == 32 << 20
    assert spec.block_size_factor == 16
    assert spec.cpu_page_size_per_worker == 16 << 20
    assert spec.num_blocks == 256


def test_block_size_defaults_to_the_gpu_block_size_and_rounds_capacity_down():
    layout = KVLayout("tiny", num_layers=2, kv_bytes_per_token_per_layer=64, gpu_block_size=4)
    spec = TieringOffloadingSpec(parse_config("cpu_bytes_to_use: 1000"), layout, instance())
    assert (spec.block_size, spec.block_size_factor, spec.bytes_per_block, spec.num_blocks) == (4, 1, 512, 1)


def test_the_fingerprint_changes_with_the_layout_only():
    config = parse_config("cpu_bytes_to_use: 1GiB\nblock_size: 32")
    base = TieringOffloadingSpec(config, KVLayout.from_preset("qwen2.5-7b"), instance()).layout_fingerprint
    assert TieringOffloadingSpec(config, KVLayout.from_preset("qwen2.5-7b"), instance()).layout_fingerprint == base
    for other in (KVLayout.from_preset("mistral-7b"), KVLayout.from_preset("qwen2.5-7b", dtype="float8")):
        assert TieringOffloadingSpec(config, other, instance()).layout_fingerprint != base


@pytest.mark.parametrize(
    ("config", "layout", "message"),
    [
        (
            "cpu_bytes_to_use: 1GiB\nblock_size: 24",
            KVLayout("m", 1, 64, 16),
            "block_size: 24 is not a multiple of the GPU block size 16",
        ),
        (
            "cpu_bytes_to_use: 100",
            KVLayout("m", 1, 64, 16),
            r"cpu_bytes_to_use: 100 bytes is smaller than one block \(1024 bytes",
        ),
        ("cpu_bytes_to_use: 1GiB", KVLayout("m", 1, 63, 1, world_size=2), "does not split between 2 workers"),
    ],
)
def test_impossible_sizes_are_refused(config, layout, message):
    with pytest.raises(ValueError, match=message):
        TieringOffloadingSpec(parse_config(config), layout, instance())
    with pytest.raises(
        ValueError, match=r"unknown model preset 'gpt-9'; known presets: gpt-oss-120b, gpt-oss-20b, llama-3\.1-70b"
    ):
        KVLayout.from_preset("gpt-9")


def test_the_manager_is_built_with_tiers_in_order_sharing_one_runtime(tmp_path):
    text = f"""
cpu_bytes_to_use: 64KiB
eviction_policy: arc
secondary_tiers:
  - type: memory
  - type: file
    root_dir: {tmp_path}
"""
    spec = TieringOffloadingSpec(parse_config(text), KVLayout("tiny", 2, 64, 4, world_size=2), instance())
    manager = spec.get_manager()
    try:
        assert spec.get_manager() is manager
        assert [tier.tier_type for tier in manager.secondary_tiers] == ["memory", "file"]
        assert manager.primary_tier.num_blocks == 128
        fingerprint = spec.layout_fingerprint  # the checkpoint weights' blocks, the identity's records and leases
        assert sorted(os.listdir(tmp_path)) == sorted(
            [
                namespace(fingerprint, CHECKPOINT).hex(),
                record_namespace(fingerprint).hex(),
                lease_namespace(fingerprint).hex(),
            ]
        )
        assert [t.name for t in threading.enumerate()].count("tiering-io") == 1
    finally:
        spec.shutdown()
        spec.shutdown()
    assert not region_path(spec.instance_id).exists()


def test_a_failing_tier_releases_everything_made_before_it(tmp_path):
    root = tmp_path / "kv"
    text = f"cpu_bytes_to_use: 64KiB\nsecondary_tiers:\n  - type: memory\n  - type: file\n    root_dir: {root}\n"
    spec = TieringOffloadingSpec(parse_config(text, "engine.yaml"), KVLayout("tiny", 2, 64, 4), instance())
    root.write_text("")  # valid when loaded, a file by the time the engine starts
    with pytest.raises(ConfigError, match=r"engine.yaml: secondary_tiers\[1\].root_dir: .*kv is not a directory"):
        spec.get_manager()
    assert not region_path(spec.instance_id).exists()
    assert not any(t.name.startswith("tiering") for t in threading.enumerate())


def test_a_failed_start_removes_the_directories_it_created_and_nothing_else(tmp_path):
    made, kept, blocked = tmp_path / "new" / "kv", tmp_path / "kept", tmp_path / "blocked"
    layout = KVLayout("tiny", 2, 64, 4)
    tier = "  - {{type: file, root_dir: {}}}\n".format
    earlier = parse_config(f"cpu_bytes_to_use: 64KiB\nsecondary_tiers:\n{tier(kept)}", "earlier.yaml")
    with TieringOffloadingSpec(earlier, layout, instance()) as spec, spec.get_manager():
        pass  # an earlier engine made kept's tree
    before = sorted(kept.rglob("*"))
    config = parse_config(
        f"cpu_bytes_to_use: 64KiB\nsecondary_tiers:\n{tier(made)}{tier(kept)}{tier(blocked)}", "e.yaml"
    )
    blocked.write_text("")  # valid when loaded; the third tier cannot open
    with pytest.raises(ConfigError, match=r"e.yaml: secondary_tiers\[2\].root_dir: .*blocked is not a directory"):
        TieringOffloadingSpec(config, layout, instance()).get_manager()
    assert not (tmp_path / "new").exists()  # what this start created, root_dir's parents too
    # what it found stays: the blocks' namespace (its segments directory: small blocks) and the
    # identity's records (one file per block: 256 shards, quarantine, the manifest)
    assert sorted(kept.rglob("*")) == before and len(before) == 2 + 259


def test_worker_handlers_fill_the_rows_the_scheduler_cascades(tmp_path):
    layout = KVLayout("tiny", num_layers=2, kv_bytes_per_token_per_layer=64, gpu_block_size=4)
    text = f"cpu_bytes_to_use: 4KiB\nblock_size: 8\nsecondary_tiers:\n  - type: file\n    root_dir: {tmp_path}\n"
    spec = TieringOffloadingSpec(parse_config(text), layout, instance())
    manager = spec.get_manager()
    try:
        gpu = [torch.randint(-128, 127, (8, 4 * 64), dtype=torch.int8) for _ in range(2)]  # 8 GPU blocks of 4 tokens
        # through the seeds' get_handlers (the vLLM adapter calls create_handlers, below)
        (src, dst, store), (_, _, load) = spec.get_handlers(canonicalize_kv_caches(gpu, 8))
        assert (src, dst) == (GPULoadStoreSpec, CPULoadStoreSpec) and load is not store
        ctx = ReqContext("r")
        out = manager.prepare_store(keys(0, 1), ctx)  # 2 offloaded blocks = 4 GPU blocks
        job = GPULoadStoreSpec([0, 1, 2, 3], [4], [0]), CPULoadStoreSpec(out.store_spec.block_ids)
        assert store.transfer_async(1, job)
        store.wait([1])
        manager.complete_store(out.keys_to_store, ctx)
        rows = np.asarray(manager.primary_tier.get_kv_memoryview())
        row = rows[out.store_spec.block_ids[0]]
        assert row[:512].tobytes() == gpu[0][0:2].numpy().tobytes()  # layer 0's two pages, then layer 1's
        assert row[512:].tobytes() == gpu[1][0:2].numpy().tobytes()
        tier = manager.secondary_tiers[0]
        assert tier.drain(10)
        manager.on_schedule_end()
        assert tier.lookup(keys(0)[0], ctx) is True
        with pytest.raises(ValueError, match="hold 512 bytes per offloaded block; the layout gives each worker 1024"):
            spec.create_handlers(canonicalize_kv_caches(gpu[:1], 8))
    finally:
        spec.shutdown()


@pytest.mark.parametrize("size", ["64TiB", "1EiB"])
def test_more_cpu_memory_than_the_shared_memory_holds_fails_at_start_naming_the_key(size):
    config = parse_config(f"cpu_bytes_to_use: {size}", "engine.yaml")
    spec = TieringOffloadingSpec(config, KVLayout("tiny", 2, 64, 4), instance())
    with pytest.raises(
        ConfigError, match=r"engine.yaml: cpu_bytes_to_use: shared region .* needs \d+ bytes; /dev/shm has"
    ):
        spec.get_manager()
    assert not region_path(spec.instance_id).exists()
