"""Every engine with a lasting tier keeps a lease on the namespaces it uses, renewed in the
background and deleted when it stops; ``tiering-config prune`` never removes a namespace a
live lease names, and removes it once the lease expired (its engine killed)."""

import asyncio
import logging
import os
import time

import pytest

from tests.test_identity import IdentitySpec, identity
from tests.test_namespaces import age, check
from tiering import config_check
from tiering.backends.file import FileBlockStore
from tiering.contract.identity import CHECKPOINT, namespace
from tiering.contract.keys import OffloadKey
from tiering.tiers.blockstore import leases
from tiering.tiers.blockstore.leases import LEASE_S, Lease, LeaseRecord, lease_namespace, read_leases

LIVE = identity("control")
FILES = {"layout": "files"}


def tier(root):
    return {"type": "file", "root_dir": str(root), **FILES}


def config_of(tmp_path, root):
    path = tmp_path / "engine.yaml"
    path.write_text(f"cpu_bytes_to_use: 1MiB\nsecondary_tiers: [{{type: file, root_dir: {root}, layout: files}}]\n")
    return str(path)


def read(root, digest=None):
    """The leases a file tier's root holds for identity `digest`."""
    store = FileBlockStore(root, lease_namespace(digest or LIVE.digest())).for_records()

    async def go():
        await store.open()
        try:
            return await read_leases(store)
        finally:
            await store.close()

    return asyncio.run(go())


def until(condition):
    while not (value := condition()):
        time.sleep(0.01)
    return value


def test_an_engines_lease_names_the_namespace_it_uses_through_a_switch_and_goes_when_it_stops(tmp_path, engine_factory):
    root = tmp_path / "kv"
    engine = engine_factory(tier(root), spec=IdentitySpec(LIVE))
    [lease] = read(root)
    checkpoint, step_1 = namespace(LIVE.digest(), CHECKPOINT), namespace(LIVE.digest(), "step-1")
    assert lease.held == {checkpoint.hex(): "the checkpoint's weights"} and lease.pid == os.getpid()
    assert lease.live(time.time()) and lease.engine == engine.tier._records.lease.engine
    engine.store(0)
    engine.manager.reset_cache("step-1")
    engine.store(1)
    # the new namespace is held before it opens; the old one once its last jobs ended, no more
    until(lambda: read(root)[0].held == {step_1.hex(): "weight version 'step-1'"})
    engine.close()
    assert read(root) == []


def test_a_lease_is_renewed_in_the_background(tmp_path, engine_factory, monkeypatch):
    monkeypatch.setattr(leases, "RENEW_S", 0.01)
    root = tmp_path / "kv"
    engine_factory(tier(root), spec=IdentitySpec(LIVE))
    [first] = read(root)
    until(lambda: read(root)[0].renewed > first.renewed)


def test_prune_keeps_what_a_live_lease_names_and_removes_it_once_the_lease_expired(tmp_path, engine_factory, capsys):
    """A reset without a declared version moves an engine to a namespace no records name:
    only its lease says it is in use. An engine killed leaves its lease, which expires."""
    root = tmp_path / "kv"
    config = config_of(tmp_path, root)
    engine = engine_factory(tier(root), spec=IdentitySpec(LIVE))
    engine.manager.reset_cache()  # a namespace of its own
    engine.store(0)
    own = until(lambda: next((ns for ns in read(root)[0].held), None) if len(read(root)[0].held) == 1 else None)
    assert own != namespace(LIVE.digest(), CHECKPOINT).hex()
    killed = Lease(
        FileBlockStore(root, lease_namespace(LIVE.digest())).for_records(), clock=lambda: time.time() - LEASE_S
    )
    lost = namespace(LIVE.digest(), "lost")  # the weights of an engine killed without deleting its lease
    (root / lost.hex() / "00").mkdir(parents=True)
    (root / lost.hex() / "00" / "0011").write_bytes(b"x" * 100)

    async def kill():
        await killed.open(lost, "weight version 'lost'")
        killed._renewal.cancel()  # as a kill -9 leaves it: never renewed, never deleted
        await killed._store.close()

    asyncio.run(kill())
    for directory in root.iterdir():
        age(directory)
    status, out = check(capsys, config)
    assert status == 0
    [own_line] = [line for line in out.splitlines() if line.startswith(f"  {own}: ")]
    assert "named by no identity's records" in own_line and "; 1 live lease (engine " in own_line
    assert f"  {lost.hex()}: 1 objects" in out and "; no live lease" in out
    assert config_check.main(["prune", config, "--unused-for", "7d"]) == 0
    out = capsys.readouterr().out
    assert f"kept {own}: " in out and f"removed {lost.hex()}: " in out
    assert (root / own).is_dir() and not (root / lost.hex()).exists()
    engine.store(1)
    assert engine.lookup_until_done(0, 1) == [True, True]


def test_a_lease_that_cannot_be_written_never_stops_the_tier(tmp_path, engine_factory, caplog):
    root = tmp_path / "kv"
    root.mkdir(mode=0o700)
    (root / lease_namespace(LIVE.digest()).hex()).write_bytes(b"not a directory")
    with caplog.at_level(logging.WARNING):
        engine = engine_factory(tier(root), spec=IdentitySpec(LIVE))
    engine.store(0)
    assert engine.lookup_until_done(0) == [True]
    assert "this engine's lease was not written" in caplog.text


@pytest.mark.parametrize("ahead_s", [LEASE_S + 60, float("inf"), float("nan")])
def test_a_lease_dated_far_ahead_or_not_a_time_is_not_live(ahead_s):
    """A clock far off, or a record written to keep namespaces from prune for good, keeps
    nothing: a lease counts as live only within `LEASE_S` of now, on either side."""
    now = 1_000_000.0
    lease = LeaseRecord(OffloadKey(b"~lease-x"), "x", "host", 1, {}, now + ahead_s)
    assert not lease.live(now)
    assert LeaseRecord(OffloadKey(b"~lease-y"), "y", "host", 1, {}, now + 60).live(now)  # a clock a minute ahead
