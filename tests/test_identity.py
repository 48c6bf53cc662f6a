"""A block is offered only to an engine of the same identity: two engines that differ in any
input that shapes a block's bytes never read each other's blocks, in a file, S3 or Valkey
tier; engines of equal identities share them."""

import json
from dataclasses import replace

import pytest

from tests.helpers import ROW, block_bytes, keys
from tiering import KVLayout
from tiering.contract.identity import KVGroupShape, ParallelShape
from tiering.tiers.context import TierContext

GROUP = KVGroupShape(("model.layers.0.attn", "model.layers.1.attn"), 16, "FullAttentionSpec")
BASE = KVLayout(
    "org/tiny",
    num_layers=2,
    kv_bytes_per_token_per_layer=64,
    gpu_block_size=16,
    dtype="bfloat16",
    world_size=2,
    revision="main",
    tokens_per_hash=16,
    groups=(GROUP,),
    parallel=ParallelShape(tensor=2),
    kv_cache_layout="NHD",
    hash_algorithm="sha256",
)
VARIANTS = {  # one field changed each; (layout, tokens per block, model_version)
    "control": (BASE, 32, None),
    "model": (replace(BASE, model="org/other"), 32, None),
    "revision": (replace(BASE, revision="v2"), 32, None),
    "model_version": (BASE, 32, "rl-step-2"),
    "dtype": (replace(BASE, dtype="fp8_e4m3"), 32, None),
    "tokens_per_block": (BASE, 64, None),
    "tokens_per_hash": (replace(BASE, tokens_per_hash=32), 32, None),
    "layer_names": (replace(BASE, groups=(replace(GROUP, layer_names=("a.0", "a.1")),)), 32, None),
    "group_kind": (replace(BASE, groups=(replace(GROUP, kind="SlidingWindowSpec", sliding_window=64),)), 32, None),
    "sliding_window": (
        replace(BASE, groups=(replace(GROUP, kind="SlidingWindowSpec", sliding_window=65),)),
        32,
        None,
    ),
    "tp_vs_pp": (replace(BASE, parallel=ParallelShape(tensor=1, pipeline=2)), 32, None),
    "pcp": (replace(BASE, parallel=ParallelShape(tensor=1, prefill_context=2)), 32, None),
    "dcp": (replace(BASE, parallel=ParallelShape(tensor=1, decode_context=2)), 32, None),
    "canonical_format": (replace(BASE, parallel=ParallelShape(tensor=2, canonical_format="v1-nhd")), 32, None),
    "kv_cache_layout": (replace(BASE, kv_cache_layout="HND"), 32, None),
    "hash_algorithm": (replace(BASE, hash_algorithm="xxhash"), 32, None),
}


def identity(variant):
    layout, tokens, version = VARIANTS[variant]
    return layout.identity(tokens, layout.kv_bytes_per_token * tokens, version)


class IdentitySpec:
    """What a tier gets from an engine of `identity` (`TieringOffloadingSpec.tier_context`)."""

    def __init__(self, engine_identity):
        self.identity = engine_identity

    def tier_context(self, view, name):
        return TierContext(name, view, self.identity.digest())


def test_every_field_changes_the_digest_and_equal_identities_share_it():
    digests = {name: identity(name).digest() for name in VARIANTS}
    assert len(set(digests.values())) == len(VARIANTS)
    assert identity("control").digest() == BASE.identity(32, BASE.kv_bytes_per_token * 32).digest()
    for changed in (replace(identity("control"), row_format=2), replace(identity("control"), object_format=2)):
        assert changed.digest() != digests["control"]
    manifest = json.loads(json.dumps(identity("control").manifest()))
    assert manifest["parallel"]["tensor"] == 2 and manifest["groups"][0]["layer_names"][0] == "model.layers.0.attn"


@pytest.fixture(params=["file", "s3", "valkey"])
def shared_tier(request, tmp_path):
    """The config of one lasting tier that every engine of the test shares."""
    if request.param == "file":
        return {"type": "file", "root_dir": str(tmp_path / "kv"), "layout": "files"}  # shared by engines
    if request.param == "s3":
        server = request.getfixturevalue("s3_server")
        bucket = request.getfixturevalue("s3_bucket")
        return {"type": "s3", "bucket": bucket, "endpoint_url": server.endpoint_url, "prefix": "kv/"}
    server = request.getfixturevalue("valkey_server")
    prefix = request.getfixturevalue("key_prefix")
    return {"type": "valkey", "addresses": [server.address], "key_prefix": prefix, "recover_index": True}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_an_engine_of_another_identity_is_never_offered_the_blocks(shared_tier, engine_factory, variant):
    writer = engine_factory(shared_tier, spec=IdentitySpec(identity("control")))
    writer.store(0, 1)
    reader = engine_factory(shared_tier, spec=IdentitySpec(identity(variant)))
    if variant == "control":
        assert reader.lookup_until_done(0, 1) == [True, True]
        assert reader.loaded_bytes(0, 1) == [block_bytes(k, ROW) for k in keys(0, 1)]
    else:
        assert reader.lookup_until_done(0, 1) == [False, False]
        assert reader.tier.num_blocks == 0
