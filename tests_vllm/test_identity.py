"""Engines built from vLLM `OffloadingConfig`s that differ in one input that shapes a block's
bytes never read each other's blocks from a shared file tier; equal configs do."""

import dataclasses
import uuid

import numpy as np
import pytest
from vllm.v1.kv_offload.config import OffloadingGroupConfig, OffloadingModelConfig, OffloadingParallelConfig

from tests_vllm.conftest import offloading_config
from tiering import ReqContext, make_offload_key
from tiering.integrations import vllm as adapter

PARALLEL = OffloadingParallelConfig(0, 2, 2, 1, 1, 1, 0, 1, None, False)  # TP=2: a row holds two slots


def base(extra):
    return dataclasses.replace(
        offloading_config(extra, engine_id=f"identity-{uuid.uuid4().hex[:8]}"), parallel=PARALLEL
    )


VARIANTS = {  # each changes one field of `base`
    "control": lambda c: c,
    "model": lambda c: dataclasses.replace(c, model=OffloadingModelConfig("other", "float32")),
    "dtype": lambda c: dataclasses.replace(c, model=OffloadingModelConfig("tiny", "bfloat16")),
    "tokens_per_hash": lambda c: dataclasses.replace(c, cache=dataclasses.replace(c.cache, tokens_per_hash=16)),
    "blocks_per_chunk": lambda c: dataclasses.replace(c, cache=dataclasses.replace(c.cache, blocks_per_chunk=4)),
    "layer_names": lambda c: dataclasses.replace(c, groups=(OffloadingGroupConfig(32, ("other.0",), 0),)),
    "group_block_size": lambda c: dataclasses.replace(c, groups=(OffloadingGroupConfig(64, ("layer.0",), 0),)),
    "tp_vs_pp": lambda c: dataclasses.replace(c, parallel=dataclasses.replace(PARALLEL, tp_size=1, pp_size=2)),
    "pcp": lambda c: dataclasses.replace(c, parallel=dataclasses.replace(PARALLEL, tp_size=1, pcp_size=2)),
    "dcp": lambda c: dataclasses.replace(c, parallel=dataclasses.replace(PARALLEL, dcp_size=2)),
    "kv_cache_layout": lambda c: dataclasses.replace(c, kv_cache_layout="LBHNC"),
    "canonical_layout": lambda c: dataclasses.replace(c, canonical_layout=True, kv_cache_layout="LBNHC"),
    "model_version": lambda c: dataclasses.replace(c, extra_config={**c.extra_config, "model_version": "step-2"}),
}


def engine(config):
    spec = adapter.KVTieringOffloadingSpec(config)
    return spec, spec.engine.get_manager()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_an_engine_of_another_config_is_never_offered_the_blocks(tmp_path, variant):
    extra = {"cpu_bytes_to_use": 1 << 20, "secondary_tiers": [{"type": "file", "root_dir": str(tmp_path)}]}
    writer_config = dataclasses.replace(base(extra), kv_cache_layout="LBNHC")
    block = make_offload_key(b"\x07" * 16, 0)
    spec, manager = engine(writer_config)
    try:
        context = ReqContext("r")
        out = manager.prepare_store([block], context)
        rows = np.asarray(manager.primary_tier.get_kv_memoryview())
        rows[out.store_spec.block_ids[0]] = 7
        manager.complete_store(out.keys_to_store, context)
        manager.on_schedule_end()
        assert manager.secondary_tiers[0].drain(10)
    finally:
        spec.shutdown()
    reader_config = VARIANTS[variant](dataclasses.replace(writer_config, engine_id=f"reader-{uuid.uuid4().hex[:8]}"))
    spec, manager = engine(reader_config)
    try:
        assert manager.secondary_tiers[0].wait_recovered(30)  # what the directory holds is indexed
        assert manager.secondary_tiers[0].lookup(block, ReqContext("r")) is (variant == "control")
    finally:
        spec.shutdown()
