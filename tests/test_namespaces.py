"""``tiering-config check`` lists what a lasting tier's root holds (each namespace, whose it is,
its size and last write) and prints the engine's identity; ``tiering-config prune`` removes
the namespaces not written for a while, never the records of blocks still in use."""

import asyncio
import os
import time
import uuid

from tests.helpers import region_name
from tests.test_identity import IdentitySpec, identity
from tiering import KVLayout, TieringOffloadingSpec, config_check, load_config, parse_config
from tiering.contract.identity import CHECKPOINT, namespace
from tiering.tiers.blockstore import leases
from tiering.tiers.blockstore.generations import record_namespace
from tiering.tiers.blockstore.leases import lease_namespace
from tiering.tiers.blockstore.namespaces import label, remove, unused

OLD = time.time() - 30 * 86400  # a month ago


def age(directory, when=OLD):
    """Make every file under `directory` last written at `when`."""
    for path in directory.rglob("*"):
        if path.is_file():
            os.utime(path, (when, when))


def check(capsys, *argv):
    status = config_check.main(["check", *argv])
    return status, capsys.readouterr().out


def test_check_lists_whose_each_namespace_is_and_prune_removes_only_the_unused(tmp_path, engine_factory, capsys):
    root = tmp_path / "kv"
    tier = {"type": "file", "root_dir": str(root), "layout": "files"}
    config = tmp_path / "engine.yaml"
    config.write_text(f"cpu_bytes_to_use: 1MiB\nsecondary_tiers: [{{type: file, root_dir: {root}, layout: files}}]\n")
    live, gone = identity("control"), identity("model")
    engine = engine_factory(tier, spec=IdentitySpec(live), num_blocks=8)
    engine.store(0, 1)
    engine.manager.reset_cache("step-1")  # a weight update: the checkpoint's namespace stays for others
    engine.store(2)
    other = engine_factory(tier, spec=IdentitySpec(gone))
    other.store(0)
    other.close()
    unnamed = root / uuid.uuid4().hex  # as a version before identities left it
    (unnamed / "00").mkdir(parents=True)
    (unnamed / "00" / "0011").write_bytes(b"x" * 100)
    step_1 = namespace(live.digest(), "step-1")
    while not (root / step_1.hex()).exists():  # the tier's loop opened it
        time.sleep(0.01)

    status, out = check(capsys, str(config))
    assert status == 0 and "tier file: 7 namespaces" in out
    mine, theirs = live.digest().hex(), gone.digest().hex()
    assert f"{record_namespace(live.digest()).hex()}: 2 objects" in out  # the manifest and the versions
    assert f"records of identity {mine} (org/tiny, " in out and "; weight versions declared: step-1" in out
    lease = f"1 live lease (engine {engine.tier._records.lease.engine} on "
    [step_1_line] = [line for line in out.splitlines() if line.startswith(f"  {step_1.hex()}: 1 objects")]
    assert "), weight version step-1; " + lease in step_1_line  # its version, its lease, its last write
    assert f"{namespace(live.digest(), CHECKPOINT).hex()}: 2 objects" in out
    assert "), the checkpoint's weights; no live lease" in out  # released once its last jobs ended
    assert f"{lease_namespace(live.digest()).hex()}: 1 objects" in out and "; " + lease in out
    assert lease_namespace(gone.digest()).hex() not in out  # its one engine stopped: its lease and namespace went
    assert f"blocks of identity {mine} (org/other" not in out and f"blocks of identity {theirs} (org/other, " in out
    assert f"{unnamed.name}: 1 objects, 100 bytes" in out and "named by no identity's records" in out

    old = [namespace(gone.digest(), CHECKPOINT), record_namespace(gone.digest()), namespace(live.digest(), CHECKPOINT)]
    for directory in [root / ns.hex() for ns in old] + [unnamed]:
        age(directory)
    age(root / record_namespace(live.digest()).hex())  # old records, but their step-1 blocks are in use: kept
    age(root / step_1.hex())  # not written for a month, but a running engine uses it: kept
    assert config_check.main(["prune", str(config), "--unused-for", "7d", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.count("would remove") == 4 and len(list(root.iterdir())) == 7
    assert f"kept {step_1.hex()}: " in out and f"{lease}" in out and "a running engine uses it" in out
    assert config_check.main(["prune", str(config), "--unused-for", "7d"]) == 0
    assert capsys.readouterr().out.count("removed") == 4
    left = [record_namespace(live.digest()), step_1, lease_namespace(live.digest())]
    assert sorted(path.name for path in root.iterdir()) == sorted(ns.hex() for ns in left)
    assert engine.lookup_until_done(2) == [True]  # the live engine goes on


def test_check_prints_the_engines_identity_and_marks_its_namespaces(tmp_path, capsys):
    config = tmp_path / "engine.yaml"
    config.write_text(f"cpu_bytes_to_use: 8MiB\nsecondary_tiers: [{{type: file, root_dir: {tmp_path / 'kv'}}}]\n")
    layout = KVLayout.from_preset("llama-3.1-8b")
    with TieringOffloadingSpec(load_config(config), layout, region_name()) as spec:
        spec.get_manager()
        digest = spec.layout_fingerprint.hex()
    status, out = check(capsys, str(config), "--model", "llama-3.1-8b")
    assert status == 0 and f"identity: {digest}" in out
    assert '"model": "llama-3.1-8b"' in out and '"tokens_per_block": 16' in out  # the manifest
    assert out.count("this engine") == 2  # its records and its generation's blocks (its lease went when it stopped)
    status, out = check(capsys, str(config))
    assert status == 0 and "this engine" not in out and "identity:" not in out


def test_an_s3_tiers_namespaces_are_listed_with_connect_and_removed_whole(s3_server, s3_bucket, engine_factory, capsys):
    tier = {"type": "s3", "bucket": s3_bucket, "endpoint_url": s3_server.endpoint_url, "prefix": "kv/"}
    for name in ("control", "model"):
        engine = engine_factory(tier, spec=IdentitySpec(identity(name)))
        engine.store(0, 1)
        engine.close()
    config = parse_config(f"cpu_bytes_to_use: 1MiB\nsecondary_tiers: [{tier}]\n", "engine.yaml")
    lines, _, failed = config_check.survey_tiers(config, None, connect=False)
    assert lines == ["tier s3: namespaces not listed (--connect lists them)"] and not failed
    lines, [(_, make, found)], failed = config_check.survey_tiers(config, identity("model").digest(), connect=True)
    assert not failed and lines[0] == "tier s3: 4 namespaces"
    assert sorted(f.kind for f in found) == ["blocks", "blocks", "records", "records"]
    assert {f.usage.objects for f in found if f.kind == "blocks"} == {2}
    assert sum(f.this_engine for f in found) == 2
    for item in unused(found, 1.0, time.time() + 3600):  # as if an hour later
        asyncio.run(remove(item, make))
    assert config_check.survey_tiers(config, None, connect=True)[0] == ["tier s3: 0 namespaces"]


def test_an_s3_namespace_a_running_engine_leases_is_never_pruned(s3_server, s3_bucket, engine_factory):
    tier = {"type": "s3", "bucket": s3_bucket, "endpoint_url": s3_server.endpoint_url, "prefix": "leased/"}
    engine = engine_factory(tier, spec=IdentitySpec(identity("control")))
    engine.store(0)
    config = parse_config(f"cpu_bytes_to_use: 1MiB\nsecondary_tiers: [{tier}]\n", "engine.yaml")
    lines, [(_, _, found)], _ = config_check.survey_tiers(config, None, connect=True)
    [blocks] = [f for f in found if f.kind == "blocks"]
    assert [lease.engine for lease in blocks.leases] == [engine.tier._records.lease.engine]
    assert any(f"; 1 live lease (engine {blocks.leases[0].engine} on " in line for line in lines)
    assert blocks.leases[0].pid == os.getpid()
    assert unused(found, 1.0, time.time() + 3600) == []  # an hour later, unwritten: still in use
    engine.close()  # its lease goes: nothing holds the namespace any more
    _, [(_, _, found)], _ = config_check.survey_tiers(config, None, connect=True)
    assert "blocks" in [f.kind for f in unused(found, 1.0, time.time() + 3600)]


def test_a_store_that_cannot_list_its_namespaces_says_so_without_reaching_its_server():
    tiers = "[{type: valkey, addresses: ['127.0.0.1:1']}, {type: memory}]"  # nothing listens; memory does not last
    config = parse_config(f"cpu_bytes_to_use: 1MiB\nsecondary_tiers: {tiers}\n", "engine.yaml")
    lines, surveyed, failed = config_check.survey_tiers(config, None, connect=True)
    assert lines == ["tier valkey: its store does not list namespaces"] and surveyed == [] and not failed


def test_prune_keeps_an_identitys_records_while_one_of_its_namespaces_could_not_be_removed(
    tmp_path, engine_factory, monkeypatch, capsys
):
    """Records removed under a namespace that stayed would start the identity again at
    generation 0, whose blocks could then be offered again."""
    root = tmp_path / "kv"
    config = tmp_path / "engine.yaml"
    config.write_text(f"cpu_bytes_to_use: 1MiB\nsecondary_tiers: [{{type: file, root_dir: {root}, layout: files}}]\n")
    engine = engine_factory(
        {"type": "file", "root_dir": str(root), "layout": "files"}, spec=IdentitySpec(identity("model"))
    )
    engine.store(0)
    engine.close()
    age(root)
    real_remove = config_check.remove

    async def blocks_stay(item, make):
        if item.kind == "blocks":
            raise PermissionError("read-only")
        await real_remove(item, make)

    monkeypatch.setattr(config_check, "remove", blocks_stay)
    assert config_check.main(["prune", str(config), "--unused-for", "7d"]) == 2
    out = capsys.readouterr()
    assert "cannot remove" in out.err and "a namespace of blocks could not be removed" in out.out
    assert len(list(root.iterdir())) == 2  # the blocks, and their identity's records


def test_identities_of_one_model_are_labelled_apart():
    """check listed every warm-start identity of the load generator as '(loadgen)'."""
    layout = KVLayout("loadgen", 4, 32, gpu_block_size=512)
    small, large = layout.identity(512, 65536), layout.identity(512, 2 << 20)
    versioned = layout.identity(512, 65536, model_version="step-42")
    labels = {label(identity.manifest()) for identity in (small, large, versioned)}
    assert len(labels) == 3 and all(text.startswith("loadgen, ") for text in labels)
    assert "loadgen, version step-42, 512 tokens / 65,536 bytes per block, bfloat16" in labels


def snapshot(root):
    """Every path under `root` (the namespaces and what they hold) with its modification time."""
    return {path: path.lstat().st_mtime_ns for path in root.rglob("*")}


def test_check_writes_nothing_and_prune_counts_no_temporary(tmp_path, engine_factory, capsys):
    """`check` ("builds nothing") made 257 directories in a namespace of one file and moved
    its modification times, which prune reads as last writes; a temporary a killed write
    left in an identity's records made them 'named by no identity' and prunable."""
    root = tmp_path / "kv"
    config = tmp_path / "engine.yaml"
    config.write_text(f"cpu_bytes_to_use: 1MiB\nsecondary_tiers: [{{type: file, root_dir: {root}, layout: files}}]\n")
    live = identity("control")
    engine = engine_factory({"type": "file", "root_dir": str(root), "layout": "files"}, spec=IdentitySpec(live))
    engine.store(0, 1)
    engine.close()
    unnamed = root / uuid.uuid4().hex  # one file
    (unnamed / "00").mkdir(parents=True)
    (unnamed / "00" / "0011").write_bytes(b"x" * 100)
    records = root / record_namespace(live.digest()).hex()
    next(path for path in records.rglob("*") if path.is_file()).with_suffix(".tmp").write_bytes(b"torn")  # kill -9
    before = snapshot(root)
    status, out = check(capsys, str(config))
    assert status == 0 and snapshot(root) == before  # nothing made or touched in a namespace (the root's
    # own try of the storage, a file made and removed beside them, is what check says it does)
    assert f"{records.name}: 1 objects" in out and f"records of identity {live.digest().hex()}" in out
    assert f"{unnamed.name}: 1 objects, 100 bytes" in out and "named by no identity's records" in out


def test_prune_never_removes_the_segments_of_a_running_engine_however_idle(
    tmp_path, engine_factory, monkeypatch, capsys
):
    """`prune` with ``layout: auto`` removed an idle engine's segments without its lock: its
    stores failed until it restarted. Its lease keeps prune away; without one (expired: its
    renewals lost), the segments' lock still does."""
    root = tmp_path / "kv"
    config = tmp_path / "engine.yaml"
    config.write_text(f"cpu_bytes_to_use: 1MiB\nsecondary_tiers: [{{type: file, root_dir: {root}}}]\n")
    engine = engine_factory({"type": "file", "root_dir": str(root)}, spec=IdentitySpec(identity("control")))
    engine.store(0, 1)
    assert engine.tier.store.layout == "segments"  # small blocks: auto chose them
    for directory in root.iterdir():
        age(directory)  # nothing written for a month: an idle engine
    assert config_check.main(["prune", str(config), "--unused-for", "7d"]) == 0
    out = capsys.readouterr().out
    assert f"kept {engine.tier.store.directory.name}: " in out and "a running engine uses it" in out
    monkeypatch.setattr(leases, "LEASE_S", 0.0)  # every lease expired
    assert config_check.main(["prune", str(config), "--unused-for", "7d"]) == 2
    out, err = capsys.readouterr()
    assert f"cannot remove {engine.tier.store.directory.name}" in err and "held by a running engine" in err
    assert "kept" in out  # its records stay too
    engine.store(2, 3)
    assert engine.lookup_until_done(0, 1, 2, 3) == [True] * 4  # the engine goes on
