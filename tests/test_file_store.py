import os
import re
import shutil
import stat

import pytest

from tests.helpers import key
from tiering import ObjectNotFoundError
from tiering.backends import FileBlockStore
from tiering.backends.file import dirs as file_dirs
from tiering.backends.file import objects as file_io
from tiering.backends.file.objects import ALIGN
from tiering.backends.file.store import CALLS_PER_CPU
from tiering.testing import BlockStoreSuite, StoreKit
from tiering.testing.block_store import FINGERPRINT, KEY, NEW_KEY, buffer, opened, payload
from tiering.tiers.seal import Seal


@pytest.fixture(params=["direct", "buffered"])
def store_kit(tmp_path, request):
    def write_raw(store, key, raw):
        store.path(key).write_bytes(raw)

    direct = request.param == "direct"
    return StoreKit(
        make=lambda fingerprint: FileBlockStore(tmp_path, fingerprint, io_threads=4, direct_io=direct),
        read_raw=lambda store, key: store.path(key).read_bytes(),
        write_raw=write_raw,
    )


class TestBlockStoreConformance(BlockStoreSuite):
    """Every test of `tiering.testing.BlockStoreSuite`, on this store."""


@pytest.mark.asyncio
async def test_files_are_private_and_sharded_under_the_layout_namespace(store_kit, tmp_path):
    store = await opened(store_kit)
    try:
        await store.put(key(1), payload(100))
        path = store.path(key(1))
        assert path.parent.parent == tmp_path / FINGERPRINT.hex()
        assert path.name == key(1).hex()
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        assert stat.S_IMODE(store.directory.stat().st_mode) == 0o700
    finally:
        await store.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("hostile", [b"../../etc/passwd", b"/abs/path", b"a\0b", bytes(range(256))[:100]])
async def test_hostile_keys_stay_inside_the_directory(store_kit, hostile):
    store = await opened(store_kit)
    try:
        await store.put(hostile, payload(10))
        path = store.path(hostile).resolve()
        assert path.is_relative_to(store.directory.resolve())
        assert await store.exists(hostile)
    finally:
        await store.close()


@pytest.mark.asyncio
async def test_recovery_removes_temporaries_and_foreign_files(store_kit):
    store = await opened(store_kit)
    await store.put(key(1), payload(100))
    await store.put(key(2), payload(100))
    await store.close()
    shard = store.path(key(1)).parent
    (shard / "deadbeef.1234.tmp").write_bytes(b"half a write")  # a crash mid-write, long ago
    os.utime(shard / "deadbeef.1234.tmp", (0, os.stat(shard).st_mtime - file_io.TEMPORARY_GRACE_S - 1))
    (shard / "not-hex-at-all").write_bytes(b"junk")
    store.path(key(2)).write_bytes(store.path(key(2)).read_bytes()[:-5])  # torn object
    reopened = await opened(store_kit)
    try:
        assert [k for k, _ in await reopened.recover()] == [key(1)]
        assert store.path(key(1)).exists()
        assert not (shard / "deadbeef.1234.tmp").exists()
        assert not (shard / "not-hex-at-all").exists()
        assert not store.path(key(2)).exists()
    finally:
        await reopened.close()


@pytest.mark.asyncio
async def test_a_restart_leaves_another_engines_write_in_flight_alone(store_kit):
    """Two engines share a namespace; one restarts while the other is writing a block."""
    writer = await opened(store_kit)
    restarting = await opened(store_kit)
    try:
        await writer.put(key(1), payload(100))
        await restarting.close()
        in_flight = writer.path(key(3)).parent / "0123456789abcdef.tmp"  # the writer's next block, half written
        in_flight.write_bytes(writer.path(key(1)).read_bytes()[:50])
        restarting = await opened(store_kit)
        assert [k for k, _ in await restarting.recover()] == [key(1)]
        assert in_flight.exists()  # before, recovery removed it, and the writer's rename would fail
    finally:
        await writer.close()
        await restarting.close()


@pytest.mark.asyncio
async def test_a_long_recovery_logs_its_progress(store_kit, monkeypatch, caplog):
    import logging

    store = await opened(store_kit)
    for i in range(3):
        await store.put(key(i), payload(100))
    await store.close()
    monkeypatch.setattr("tiering.tiers.blockstore.store.PROGRESS_INTERVAL_S", 0.0)  # a line per object
    reopened = await opened(store_kit)
    try:
        with caplog.at_level(logging.INFO, logger="tiering"):
            assert len(await reopened.recover()) == 3
    finally:
        await reopened.close()
    line = rf"file tier {re.escape(str(store.directory))}: recovering, 3 objects looked at in \d+ s"
    assert re.search(line, caplog.text)


@pytest.mark.asyncio
@pytest.mark.parametrize("layout", ["files", "segments"])
async def test_buffered_one_file_calls_run_two_per_cpu_at_once(store_kit, layout, tmp_path):
    """Buffered calls of the one-file layout keep a CPU busy each (a copy and a checksum per
    block): the store asks for no more at once than `CALLS_PER_CPU` per CPU it may use. With
    O_DIRECT (the disk's queue) and in segments (Python and system calls) the tier's cut
    stands."""
    if layout == "files":
        store = await opened(store_kit)
    else:  # buffered, as the one-file case that is capped: only the layout differs
        store = FileBlockStore(tmp_path, FINGERPRINT, 4, direct_io=False, layout=layout)
        await store.open()
    try:
        cpu_bound = layout == "files" and not store.direct_io
        assert store.calls_at_once == (CALLS_PER_CPU * len(os.sched_getaffinity(0)) if cpu_bound else None)
    finally:
        await store.close()


@pytest.mark.asyncio
async def test_fsync_mode_round_trips(tmp_path):
    store = FileBlockStore(tmp_path, FINGERPRINT, io_threads=2, fsync=True)
    await store.open()
    try:
        data = payload(8192)
        await store.put(key(1), data)
        into = memoryview(bytearray(8192))
        await store.get(key(1), into)
        assert into == data
    finally:
        await store.close()


@pytest.mark.asyncio
async def test_unusable_root_dir_is_a_clear_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"")
    store = FileBlockStore(blocker / "sub", FINGERPRINT)
    with pytest.raises(OSError, match=r"file tier: cannot use .*a-file/sub"):
        await store.open()


@pytest.mark.asyncio
@pytest.mark.parametrize("removed", ["shard", "shard replaced by a link", "namespace"])
async def test_a_directory_removed_while_open_is_made_again_and_the_rest_keeps_serving(tmp_path, removed, caplog):

    store = FileBlockStore(tmp_path / "kv", FINGERPRINT, io_threads=2, direct_io=False)
    await store.open()
    try:
        lost = key(1)
        same_shard = next(key(i) for i in range(2, 10_000) if file_dirs.shard(key(i)) == file_dirs.shard(lost))
        elsewhere = next(key(i) for i in range(2, 10_000) if file_dirs.shard(key(i)) != file_dirs.shard(lost))
        data = {k: payload(4096) for k in (lost, same_shard, elsewhere)}
        for k in (lost, elsewhere):
            await store.put(k, data[k])
        shard = store.path(lost).parent
        shutil.rmtree(store.directory if removed == "namespace" else shard)
        if removed == "shard replaced by a link":
            (tmp_path / "elsewhere").mkdir()
            shard.symlink_to(tmp_path / "elsewhere")
        await store.put(same_shard, data[same_shard])  # the shard (and namespace) made again
        assert shard.is_dir() and not shard.is_symlink() and store.path(same_shard).exists()
        into = buffer(4096)
        await store.get(same_shard, into)
        assert into == data[same_shard]
        with pytest.raises(ObjectNotFoundError):
            await store.get(lost, buffer(4096))  # gone with its shard: a miss, never wrong bytes
        if removed != "namespace":
            await store.get(elsewhere, into)  # other shards are untouched
            assert into == data[elsewhere]
        assert "was removed while in use; made it again" in caplog.text
        if removed == "shard replaced by a link":
            assert list((tmp_path / "elsewhere").iterdir()) == []  # the link's target is left alone
    finally:
        await store.close()


@pytest.mark.asyncio
async def test_undoing_an_open_removes_only_empty_directories_it_created(tmp_path):
    root = tmp_path / "a" / "kv"
    first, second = FileBlockStore(root, FINGERPRINT), FileBlockStore(root, FINGERPRINT)
    await first.open()  # creates a/, a/kv/ and the namespace
    await second.open()  # another engine of the same layout, sharing it
    try:
        data = payload(100)
        await second.put(key(1), data)
        await first.undo_open()  # first's start failed: the namespace in use stays whole
        into = buffer(100)
        await second.get(key(1), into)
        assert into == data
        await second.put(key(2), data)  # into another shard
    finally:
        await second.close()
    await second.undo_open()  # it created nothing: nothing goes
    assert second.path(key(1)).exists()
    alone = FileBlockStore(tmp_path / "b" / "kv", FINGERPRINT)
    await alone.open()
    await alone.undo_open()
    assert not (tmp_path / "b").exists()


def test_aligned_rows_bypass_the_page_cache_and_others_fall_back(tmp_path, monkeypatch):
    from tiering.backends.file import objects as file_io

    namespace = file_dirs.open_namespace(tmp_path, FINGERPRINT.hex())
    namespace.make_shards()
    opened_flags = []
    real_open = os.open

    def recording_open(path, flags, *args, **kwargs):
        if not flags & os.O_DIRECTORY:
            opened_flags.append(bool(flags & os.O_DIRECT))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(file_io.os, "open", recording_open)
    aligned, unaligned = payload(8192), memoryview(bytearray(8192))
    try:
        file_io.write_object(namespace, key(1), aligned, FINGERPRINT, None, False, True)
        file_io.read_object(namespace, key(1), buffer(8192), FINGERPRINT, None, True)
        file_io.write_object(namespace, key(2), unaligned[1:4097], FINGERPRINT, None, False, True)
        file_io.write_object(namespace, key(3), aligned, FINGERPRINT, None, False, False)
    finally:
        namespace.close()
    assert opened_flags == [True, True, False, False]


@pytest.mark.asyncio
@pytest.mark.parametrize("layout", ["files", "segments"])
async def test_a_restart_reclaims_the_objects_of_a_key_dropped_from_integrity(tmp_path, layout, caplog):
    """After a rotation drops a key, what it sealed can never be loaded: its objects (and
    segment entries) were kept, counted nowhere and never removed. The next start reclaims
    them, says how many, and keeps what the tier's keys open."""

    def store(seal):
        made = FileBlockStore(tmp_path, FINGERPRINT, 2, direct_io=False, layout=layout)
        made.seal = seal
        return made

    old = store(Seal([KEY]))
    await old.open()
    for i in range(4):
        await old.put(key(i), payload(64 << 10, seed=i + 1))
    await old.close()
    rotated = store(Seal([NEW_KEY, KEY]))  # seals with the new key, still opens the old
    await rotated.open()
    await rotated.recover()
    await rotated.put(key(9), payload(64 << 10, seed=9))
    await rotated.close()
    used = sum(f.stat().st_blocks for f in tmp_path.rglob("*") if f.is_file())
    dropped = store(Seal([NEW_KEY]))  # the old key dropped
    await dropped.open()
    try:
        assert dict(await dropped.recover()) == {key(9): ALIGN + (64 << 10)}
        what = "objects" if layout == "files" else "segment entries"
        assert f"reclaimed 4 {what} whose seal does not open" in caplog.text
        into = buffer(64 << 10)
        await dropped.get(key(9), into)
        with pytest.raises(ObjectNotFoundError):
            await dropped.get(key(0), buffer(64 << 10))
    finally:
        await dropped.close()
    assert sum(f.stat().st_blocks for f in tmp_path.rglob("*") if f.is_file()) * 512 <= used * 512 - 4 * (64 << 10)
