"""A block is offered only to an engine of the same identity and generation: two engines that
differ in any input that shapes a block's bytes never read each other's blocks, in a file, S3
or Valkey tier, and nothing stored before a reset is offered again."""

import json
import os
import signal
import threading
import time
from dataclasses import replace

import numpy as np
import pytest

from tests.helpers import CTX, ROW, block_bytes, keys
from tiering import KVLayout
from tiering.contract.identity import KVGroupShape, ParallelShape, namespace
from tiering.engine.admission import AdmissionConfig
from tiering.testing.s3_server import MotoServer
from tiering.tiers.blockstore.generations import MANIFEST_BYTES, record_namespace
from tiering.tiers.blockstore.leases import lease_namespace
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
        return TierContext(name, view, self.identity.digest(), None, None, self.identity.manifest())


def test_every_field_changes_the_digest_and_equal_identities_share_it():
    digests = {name: identity(name).digest() for name in VARIANTS}
    assert len(set(digests.values())) == len(VARIANTS)
    assert identity("control").digest() == BASE.identity(32, BASE.kv_bytes_per_token * 32).digest()
    control = identity("control")
    for changed in (
        replace(control, row_format=control.row_format + 1),
        replace(control, object_format=control.object_format + 1),
    ):
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
        assert len(reader.tier.index) == 0


def wait_for(fact, what, timeout_s=30.0):
    """Wait until `fact()` holds (a fact the loop thread makes true), or fail naming `what`."""
    deadline = time.monotonic() + timeout_s
    while not fact():
        assert time.monotonic() < deadline, f"still not {what} after {timeout_s} s"
        threading.Event().wait(0.01)


def moved(engine, weight_version):
    """`engine` reset to `weight_version` (None: none declared), once its tier opened the new namespace."""
    before = engine.tier.store
    engine.manager.reset_cache(weight_version)
    engine.manager.on_schedule_end()  # the tier's loop hears of it at the step's end
    wait_for(lambda: engine.tier.store is not before, "in the new namespace")


def test_replicas_share_blocks_on_one_weight_version_and_never_across_versions(shared_tier, engine_factory):
    """A replica one update behind joined the namespace of a replica ahead of it (a reset
    recorded max(own + 1, recorded)): A, after two updates, was offered KV that B computed with
    its one-update-old weights. A namespace is now the identity and the declared weights."""
    tier = {**shared_tier, "probe_misses": True}
    spec = IdentitySpec(identity("control"))
    a, b = engine_factory(tier, spec=spec, num_blocks=8), engine_factory(tier, spec=spec, num_blocks=8)
    a.store(0, 1)  # both on the checkpoint's weights: shared
    assert b.lookup_until_done(0, 1) == [True, True]
    moved(a, "step-1")
    moved(a, "step-2")  # two updates
    moved(b, "step-1")  # one update
    b.store(2)
    a.store(3)
    assert a.lookup_until_done(0, 1, 2) == [False, False, False]  # the checkpoint's and step-1's: never
    assert b.lookup_until_done(3) == [False]  # step-2's: never, in either direction
    moved(b, "step-2")  # B catches up: the same weights, the same namespace, whenever it got there
    assert b.lookup_until_done(3) == [True]
    assert b.loaded_bytes(3) == [block_bytes(keys(3)[0], ROW)]
    fresh = engine_factory(tier, spec=spec, num_blocks=8)  # a replica that starts on the checkpoint
    assert fresh.lookup_until_done(0, 1, 2, 3) == [True, True, False, False]
    moved(fresh, None)  # a reset that declares no version: a namespace of its own
    assert fresh.lookup_until_done(0, 1, 2, 3) == [False] * 4
    fresh.store(4)
    assert b.lookup_until_done(4) == [False] and a.lookup_until_done(4) == [False]


def test_reset_scope_cpu_keeps_the_lasting_tiers_blocks(tmp_path, engine_factory):
    tier = {"type": "file", "root_dir": str(tmp_path / "kv")}
    engine = engine_factory(tier, spec=IdentitySpec(identity("control")), reset_scope="cpu")
    engine.store(0, 1)
    engine.manager.reset_cache()
    assert engine.lookup_until_done(0, 1) == [True, True]


def test_a_reset_keeps_the_namespaces_of_declared_weights_and_removes_an_engines_own(tmp_path, engine_factory):
    """Other replicas may still run the weights a reset leaves: their namespace stays (prune
    reclaims it once unused); one no other engine can reach goes at the next reset."""
    root = tmp_path / "kv"
    spec = IdentitySpec(identity("control"))
    engine = engine_factory({"type": "file", "root_dir": str(root)}, spec=spec)
    engine.store(0, 1)
    checkpoint = engine.tier.store.directory
    records = root / record_namespace(spec.identity.digest()).hex()
    leases = lease_namespace(spec.identity.digest()).hex()
    assert sorted(os.listdir(root)) == sorted([checkpoint.name, records.name, leases])
    moved(engine, None)
    own = engine.tier.store.directory
    engine.store(2)
    moved(engine, "step-1")
    wait_for(lambda: not own.exists(), "removed")
    assert sorted(os.listdir(root)) == sorted([checkpoint.name, engine.tier.store.directory.name, records.name, leases])
    # the manifest, in plain words at the end of its object
    manifest_file = next(path for path in records.rglob("*") if path.is_file() and path.stat().st_size > MANIFEST_BYTES)
    manifest = json.loads(manifest_file.read_bytes()[-MANIFEST_BYTES:])
    assert manifest["identity"] == spec.identity.digest().hex() and manifest["model"] == "org/tiny"


def test_a_weight_version_is_printable_and_bounded():
    from tiering.contract.identity import check_weight_version

    for good in (None, "step-1200", "sha256:" + "a" * 64, "x" * 256):
        check_weight_version(good)
    for bad in ("", "two words", "x" * 257, "tab\there", 7):
        with pytest.raises(ValueError, match="printable ASCII characters without blanks"):
            check_weight_version(bad)


@pytest.mark.parametrize("layout", ["files", "segments"])
def test_an_engine_started_on_a_full_disk_starts_fails_its_stores_and_stores_once_there_is_room(
    small_disk, engine_factory, monkeypatch, layout
):
    """A full disk refused the segment layout's check of hole punching ("cannot punch holes")
    and the first engine's manifest: the engine did not start. It starts, its stores fail
    as no-space, and it stores again (and writes its manifest at its next start) once room
    comes back."""
    monkeypatch.setattr("tiering.tiers.blockstore.index.ROOM_BACKOFF_S", (0.0, 0.0))  # retried at once
    filler = small_disk / "someone-elses-file"
    with open(filler, "wb", buffering=0) as out, pytest.raises(OSError, match="No space"):
        while True:
            out.write(bytes(4096))
    tier = {"type": "file", "root_dir": str(small_disk / "kv"), "layout": layout, "direct_io": False}
    spec = IdentitySpec(identity("control"))
    engine = engine_factory(tier, spec=spec, num_blocks=8)
    engine.store(0, 1)
    assert engine.tier.failures["store_no_space"] == 2 and len(engine.tier.index) == 0
    filler.unlink()
    engine.store(2, 3)
    assert len(engine.tier.index) == 2
    engine.manager.shutdown()
    engine_factory(tier, spec=spec, num_blocks=8)  # writes the manifest now
    records = small_disk / "kv" / record_namespace(spec.identity.digest()).hex()
    assert any(path.stat().st_size > MANIFEST_BYTES for path in records.rglob("*") if path.is_file())


def test_a_reset_returns_at_once_with_a_frozen_s3_endpoint_and_the_tier_moves_on_when_it_thaws(
    s3_environment, engine_factory
):
    server = MotoServer()
    server.start()
    try:
        server.create_bucket("frozen")
        config = {
            "type": "s3",
            "bucket": "frozen",
            "endpoint_url": server.endpoint_url,
            "read_timeout_s": 0.5,
            "connect_timeout_s": 0.5,
        }
        spec = IdentitySpec(identity("control"))
        engine = engine_factory(config, spec=spec, num_blocks=8)
        engine.store(0, 1)
        before = engine.tier.store
        os.kill(server.pid, signal.SIGSTOP)  # alive, listening, silent
        try:
            engine.manager.reset_cache("step-1")  # would hang here if it waited for the endpoint
            engine.manager.on_schedule_end()
            assert True not in [engine.manager.lookup(k, CTX) for k in keys(0, 1)]  # a miss, or a probe
        finally:
            os.kill(server.pid, signal.SIGCONT)
        wait_for(lambda: engine.tier.store is not before, "in the new namespace")
        assert engine.lookup_until_done(0, 1, steps=20) == [False, False]
        fresh = engine_factory(config, spec=spec, num_blocks=8)  # on the checkpoint's weights: they are its
        assert fresh.lookup_until_done(0, 1, steps=20) == [True, True]
    finally:
        server.stop()


def manifest_file(root, spec):
    records = root / record_namespace(spec.identity.digest()).hex()
    return next(path for path in records.rglob("*") if path.is_file() and path.stat().st_size > MANIFEST_BYTES)


@pytest.mark.parametrize("defect", ["another identity", "bytes of a stranger"])
def test_a_manifest_that_does_not_open_or_names_another_identity_is_written_again_and_the_tier_opens(
    tmp_path, engine_factory, caplog, defect
):
    """Anyone who could write the directory stopped every engine of the identity for good
    (`ForeignManifestError`): the manifest is a label, the namespaces come from the identity."""
    root = tmp_path / "kv"
    tier = {"type": "file", "root_dir": str(root), "layout": "files", "probe_misses": True}
    spec = IdentitySpec(identity("control"))
    engine_factory(tier, spec=spec).store(0)
    path = manifest_file(root, spec)
    if defect == "another identity":  # its checksum no longer matches either
        data = bytearray(path.read_bytes())
        data[-MANIFEST_BYTES:] = data[-MANIFEST_BYTES:].replace(spec.identity.digest().hex().encode(), b"0" * 32)
        path.write_bytes(bytes(data))
    else:
        path.write_bytes(b"planted" * 1000)
    again = engine_factory(tier, spec=spec)  # opens
    assert again.lookup_until_done(0) == [True]  # the blocks are read as before
    assert again.tier._records.rewritten == 1 and "its manifest cannot be read" in caplog.text
    manifest = json.loads(manifest_file(root, spec).read_bytes()[-MANIFEST_BYTES:])
    assert manifest["identity"] == spec.identity.digest().hex()  # written again
    assert engine_factory(tier, spec=spec).tier._records.rewritten == 0


def test_records_that_expire_or_are_removed_cost_labels_only(shared_tier, engine_factory):
    """A Valkey TTL, an LRU maxmemory, an S3 lifecycle rule or a prune that removed the
    generation record made later engines join generation 0: split from the fleet, offered
    blocks a not-yet-reset replica stored there. A namespace no longer depends on a record."""
    import asyncio

    from tiering.tiers.blockstore.generations import read_records

    tier = {**shared_tier, "probe_misses": True}
    spec = IdentitySpec(identity("control"))
    a = engine_factory(tier, spec=spec, num_blocks=8)
    moved(a, "step-1")
    a.store(0)
    behind = engine_factory(tier, spec=spec, num_blocks=8)  # a replica not updated yet
    behind.store(1)

    async def expire() -> None:  # the identity's records, gone by the store's own policy
        records = a.tier._records._make_store(record_namespace(spec.identity.digest()), False).for_records()
        await records.open()
        try:
            await records.remove_namespace()
        finally:
            await records.close()

    asyncio.run(expire())
    later = engine_factory(tier, spec=spec, num_blocks=8)  # starts on the checkpoint, as a restart does
    moved(later, "step-1")
    assert later.lookup_until_done(0, 1) == [True, False]  # the fleet's step-1 blocks, never the checkpoint's

    async def listed() -> list[str]:
        records = later.tier._records._make_store(record_namespace(spec.identity.digest()), False).for_records()
        await records.open()
        try:
            return (await read_records(records))[1]
        finally:
            await records.close()

    assert asyncio.run(listed()) == ["step-1"]  # the labels written again


def test_a_store_admitted_before_a_switch_never_lands_in_the_new_weights_namespace(tmp_path, engine_factory):
    """Blocks computed with the old weights: a GPU store whose rows were reserved before the
    switch and completed after it (a caller that did not void it), and a cascade still queued
    from a row written before it. Neither reaches the new namespace, nor is announced there."""
    tier = {"type": "file", "root_dir": str(tmp_path / "kv"), "layout": "files", "probe_misses": True}
    spec = IdentitySpec(identity("control"))
    write_back = [AdmissionConfig(write="back", writeback_window=1)]
    engine = engine_factory(tier, spec=spec, num_blocks=8, admission=write_back)
    engine.store(0, 1)  # write-back: their cascades wait in the CPU tier
    out = engine.manager.prepare_store(keys(2), CTX)  # admitted under the checkpoint's weights
    for k, row in zip(out.keys_to_store, out.store_spec.block_ids, strict=True):
        engine.rows[row] = np.frombuffer(block_bytes(k, ROW), dtype=engine.rows.dtype)
    moved(engine, "step-1")
    engine.manager.complete_store(out.keys_to_store, CTX)
    engine.settle()
    engine.manager.take_events()
    fresh = engine_factory(tier, spec=spec, num_blocks=8)
    moved(fresh, "step-1")
    assert fresh.lookup_until_done(0, 1, 2) == [False, False, False]  # step-1's namespace has none of them
    assert engine.lookup_until_done(0, 1, 2) == [False, False, False]
    stored = [event for event in engine.manager.take_events() if type(event).__name__ == "BlockStored"]
    assert stored == []


class VersionedSpec(IdentitySpec):
    """An engine of `identity` that starts on the declared weights `weights` (config ``weight_version``)."""

    def __init__(self, engine_identity, weights):
        super().__init__(engine_identity)
        self.weights = weights

    def tier_context(self, view, name):
        return replace(super().tier_context(view, name), weight_version=self.weights)


def test_an_engine_on_declared_weights_starts_on_a_full_disk_its_version_list_a_label_only(
    small_disk, engine_factory, caplog
):
    """The list of weight versions is a label: a store that cannot write it (a full disk) keeps
    neither the tier from opening nor the engine from its weights' namespace."""
    filler = small_disk / "someone-elses-file"
    with open(filler, "wb", buffering=0) as out, pytest.raises(OSError, match="No space"):
        while True:
            out.write(bytes(4096))
    tier = {"type": "file", "root_dir": str(small_disk / "kv"), "layout": "files", "direct_io": False}
    spec = VersionedSpec(identity("control"), "step-3")
    engine = engine_factory(tier, spec=spec, num_blocks=8)
    assert engine.tier.store.directory.name == namespace(spec.identity.digest(), "step-3").hex()
    assert "the list of weight versions was not written" in caplog.text
