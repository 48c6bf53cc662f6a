"""The file tier's segment layout: the block-store conformance suite, and what many blocks per
file must keep of the one-file layout (recovery of every whole block, nothing torn or foreign
loaded, deleted space given back, one engine per namespace, a full disk)."""

import errno
import logging
import os
import threading
import time

import numpy as np
import pytest

from tests.helpers import CTX, ROW, block_bytes, key, keys
from tiering import CorruptObjectError, ObjectNotFoundError
from tiering.backends import FileBlockStore
from tiering.backends.file import segment_fds as file_segment_fds
from tiering.backends.file import segment_io as file_segment_io
from tiering.backends.file import segments as file_segments
from tiering.backends.file.objects import ALIGN
from tiering.testing import BlockStoreSuite, StoreKit
from tiering.testing.block_store import FINGERPRINT, buffer, opened, payload

BLOCK = 64 << 10


def segment_path(store, entry) -> str:
    return str(store.directory / "segments" / entry.segment.name)


def read_raw(store, k) -> bytes:
    """The entry of `k` as its segment holds it: header page and payload, no padding."""
    entry = store._layout._map[k]
    with open(segment_path(store, entry), "rb") as f:
        f.seek(entry.offset)
        return f.read(ALIGN + entry.payload_len)


def write_raw(store, k, raw: bytes) -> None:
    """Make `raw` the entry of `k`, in place (an entry of its size first if `k` has none), as
    recovery would find it: the map takes the length it announces."""
    log = store._layout
    size = max(len(raw) - ALIGN, 1)
    if k not in log._map:
        assert log.put_many([(k, memoryview(bytearray(size)))]) == [None]
    entry = log._map[k]
    with open(segment_path(store, entry), "r+b") as f:
        f.seek(entry.offset)
        f.write(raw)
    log._map[k] = entry._replace(payload_len=size)


@pytest.fixture(params=["direct", "buffered"])
def store_kit(tmp_path, request):
    direct = request.param == "direct"
    return StoreKit(
        make=lambda fingerprint: FileBlockStore(tmp_path, fingerprint, 4, direct_io=direct, layout="segments"),
        read_raw=read_raw,
        write_raw=write_raw,
    )


class TestBlockStoreConformance(BlockStoreSuite):
    """Every test of `tiering.testing.BlockStoreSuite`, on segments."""


async def restarted(store_kit):
    store = await opened(store_kit)
    return store, dict(await store.recover())


@pytest.mark.asyncio
async def test_a_batch_is_one_write_and_reads_back_in_one_read(store_kit, monkeypatch):
    calls = {"pwritev": 0, "preadv": 0}
    for name in calls:
        real = getattr(os, name)

        def counted(*args, _real=real, _name=name):
            calls[_name] += 1
            return _real(*args)

        monkeypatch.setattr(file_segment_io.os, name, counted)
    store = await opened(store_kit)
    try:
        blocks = [(key(i), payload(BLOCK)) for i in range(16)]
        assert await store.put_many(blocks) == [None] * 16
        reads = [(key(i), buffer(BLOCK)) for i in range(16)]
        assert all(not isinstance(o, Exception) for o in await store.get_many(reads))
        assert [into for _, into in reads] == [data for _, data in blocks]
        assert calls == {"pwritev": 1, "preadv": 1}
    finally:
        await store.close()


@pytest.mark.asyncio
async def test_restart_finds_every_whole_block_over_many_segments_and_the_latest_of_a_key(store_kit, monkeypatch):
    monkeypatch.setattr(file_segments, "SEGMENT_BYTES", 4 * (ALIGN + BLOCK))
    store = await opened(store_kit)
    try:
        for start in range(0, 20, 2):
            assert (
                await store.put_many([(key(i), payload(BLOCK, seed=i + 1)) for i in (start, start + 1)]) == [None] * 2
            )
        await store.put(key(3), payload(BLOCK, seed=99))  # stored again: the older entry is punched out
    finally:
        await store.close()
    assert len(os.listdir(store.directory / "segments")) == 6
    store, found = await restarted(store_kit)
    try:
        assert list(found) == [key(i) for i in range(20) if i != 3] + [key(3)]
        into = buffer(BLOCK)
        await store.get(key(3), into)
        assert into == payload(BLOCK, seed=99)
    finally:
        await store.close()


@pytest.mark.asyncio
async def test_a_torn_tail_is_not_listed_and_a_torn_payload_never_loads(store_kit):
    store = await opened(store_kit)
    try:
        assert await store.put_many([(key(i), payload(BLOCK)) for i in range(4)]) == [None] * 4
        torn = store._layout._map[key(1)]
        path = segment_path(store, torn)
    finally:
        await store.close()
    with open(path, "r+b") as f:
        f.seek(torn.offset + ALIGN + 100)
        f.write(b"torn")  # a write cut short inside the payload
        f.truncate(3 * (ALIGN + BLOCK) + ALIGN + 10)  # the last entry cut by the end of the file
    store, found = await restarted(store_kit)
    try:
        assert list(found) == [key(0), key(1), key(2)]
        with pytest.raises(CorruptObjectError):
            await store.get(key(1), buffer(BLOCK))
        with pytest.raises(ObjectNotFoundError):
            await store.get(key(3), buffer(BLOCK))
    finally:
        await store.close()


@pytest.mark.asyncio
async def test_garbage_and_foreign_layout_pages_are_skipped_and_what_follows_found(store_kit, tmp_path):
    store = await opened(store_kit)
    try:
        assert await store.put_many([(key(i), payload(BLOCK)) for i in range(3)]) == [None] * 3
        first = store._layout._map[key(0)]
        path = segment_path(store, first)
    finally:
        await store.close()
    other = FileBlockStore(tmp_path / "other", bytes(range(16)), 2, layout="segments")
    await other.open()
    try:
        await other.put(key(9), payload(BLOCK))
        foreign = read_raw(other, key(9))
    finally:
        await other.close()
    with open(path, "r+b") as f:
        f.write(b"\xff" * ALIGN)  # the first entry's header: garbage
        f.seek(first.offset + ALIGN + BLOCK)
        f.write(foreign)  # the second: another layout's entry
    store, found = await restarted(store_kit)
    try:
        assert list(found) == [key(2)]
    finally:
        await store.close()


@pytest.mark.asyncio
async def test_a_look_alike_header_inside_a_payload_never_takes_a_block_from_recovery(store_kit):
    """Recovery steps page by page through an entry whose header is torn; a page of its
    payload that merely looks like another block's header (a copy with a byte changed) used
    to be trusted: the later entry of that key, so the real block was punched out."""
    store = await opened(store_kit)
    try:
        assert await store.put(key(0), payload(BLOCK, seed=3)) is None
        look_alike = bytearray(read_raw(store, key(0))[:ALIGN])
        look_alike[36] ^= 0x01  # the payload checksum's field: the header's own check fails, nothing else
        carrier = bytearray(payload(BLOCK, seed=7))
        carrier[ALIGN : 2 * ALIGN] = look_alike  # the carrier's second payload page
        assert await store.put(key(1), memoryview(carrier)) is None
        assert await store.put(key(2), payload(BLOCK, seed=5)) is None  # what the look-alike would span
        torn = store._layout._map[key(1)]
        path = segment_path(store, torn)
    finally:
        await store.close()
    with open(path, "r+b") as f:
        f.seek(torn.offset)
        f.write(b"\xff" * ALIGN)  # the carrier's own header: torn
    store, found = await restarted(store_kit)
    try:
        into = buffer(BLOCK)
        await store.get(key(0), into)
        assert into == payload(BLOCK, seed=3)
        assert list(found) == [key(0), key(2)] and store._layout.headers_rejected == 1  # the look-alike, counted
    finally:
        await store.close()


@pytest.mark.asyncio
async def test_deletes_give_the_space_back_and_remove_segments_left_empty(store_kit, monkeypatch):
    monkeypatch.setattr(file_segments, "SEGMENT_BYTES", 4 * (ALIGN + BLOCK))
    store = await opened(store_kit)
    try:
        for start in (0, 4):
            assert await store.put_many([(key(i), payload(BLOCK)) for i in range(start, start + 4)]) == [None] * 4
        first = store._layout._map[key(0)]
        allocated = os.stat(segment_path(store, first)).st_blocks
        await store.delete_many([key(0), key(1)])
        assert os.stat(segment_path(store, first)).st_blocks <= allocated - 2 * BLOCK // 512
        await store.delete_many([key(2), key(3)])
        assert not os.path.exists(segment_path(store, first))  # not the active one: removed
        assert await store.exists(key(4)) and not await store.exists(key(0))
    finally:
        await store.close()
    store, found = await restarted(store_kit)
    try:
        assert list(found) == [key(i) for i in range(4, 8)]
    finally:
        await store.close()


@pytest.mark.asyncio
async def test_a_second_engine_on_the_same_segments_fails_naming_them(tmp_path):
    first = FileBlockStore(tmp_path, FINGERPRINT, 2, layout="segments")
    await first.open()
    try:
        second = FileBlockStore(tmp_path, FINGERPRINT, 2, layout="segments")
        with pytest.raises(BlockingIOError, match=r"segments is in use by another engine.*layout: files"):
            await second.open()
    finally:
        await first.close()


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("layout", "block_bytes", "segments"),
    [("auto", 64 << 10, True), ("auto", 1 << 20, False), ("auto", None, False), ("files", 64 << 10, False)],
)
async def test_auto_keeps_small_blocks_in_segments(tmp_path, layout, block_bytes, segments):
    store = FileBlockStore(tmp_path, FINGERPRINT, 2, layout=layout)
    store.block_bytes = block_bytes
    await store.open()
    try:
        assert isinstance(store._layout, file_segments.SegmentLog) is segments
        assert store.layout == ("segments" if segments else "files")
    finally:
        await store.close()


def small_store(tmp_path, layout="auto") -> FileBlockStore:
    store = FileBlockStore(tmp_path, FINGERPRINT, 2, direct_io=False, layout=layout)
    store.block_bytes = BLOCK
    return store


@pytest.mark.asyncio
async def test_auto_keeps_one_file_per_block_where_the_namespace_holds_such_objects(tmp_path, caplog):
    caplog.set_level(logging.INFO, "tiering.backends.file")
    older = small_store(tmp_path, "files")  # an older engine's cache, or engines sharing the directory
    await older.open()
    await older.put(key(1), payload(BLOCK, 1))
    await older.close()
    store = small_store(tmp_path)
    await store.open()
    try:
        assert store.layout == "files" and dict(await store.recover()) == {key(1): ALIGN + BLOCK}
        into = buffer(BLOCK)
        await store.get(key(1), into)
        assert bytes(into) == payload(BLOCK, 1)
        assert "holds one file per block already" in caplog.text
    finally:
        await store.close()


@pytest.mark.asyncio
async def test_auto_gives_a_second_engine_one_file_per_block_where_the_first_holds_the_segments(tmp_path, caplog):
    first, second = small_store(tmp_path), small_store(tmp_path)
    await first.open()
    try:
        await second.open()
        try:
            assert (first.layout, second.layout) == ("segments", "files")
            assert "in use by another engine" in caplog.text
            await second.put(key(2), payload(BLOCK, 2))
            assert await second.exists(key(2)) and not await first.exists(key(2))
        finally:
            await second.close()
    finally:
        await first.close()


@pytest.mark.asyncio
async def test_when_the_first_engine_restarts_beside_the_seconds_files_its_orphaned_segments_go(tmp_path, caplog):
    """A held the segments, so B took one file per block; A restarts, sees B's files and
    takes them too: its segments, which no engine holds any more, are removed (once never
    recovered, counted or removed); segments an engine holds stay."""
    first, second = small_store(tmp_path), small_store(tmp_path)
    await first.open()
    await first.put(key(1), payload(BLOCK, 1))
    await second.open()
    await second.put(key(2), payload(BLOCK, 2))
    segments = first.directory / "segments"
    third = small_store(tmp_path)  # another engine while A holds its segments: they stay
    await third.open()
    await third.close()
    assert any(segments.iterdir())
    await first.close()
    again = small_store(tmp_path)  # A, restarted
    await again.open()
    try:
        assert again.layout == "files" and not segments.exists()
        assert dict(await again.recover()) == {key(2): ALIGN + BLOCK}
        assert "removed segments no engine held" in caplog.text
    finally:
        await again.close()
        await second.close()


@pytest.mark.asyncio
async def test_a_full_disk_fails_the_write_and_a_delete_makes_room(small_disk):
    store = FileBlockStore(small_disk / "tier", FINGERPRINT, 2, direct_io=False, layout="segments")
    await store.open()
    try:
        stored = []
        for i in range(64):  # 1 MiB of disk: 16 blocks of 64 KiB at most
            outcome = await store.put_many([(key(i), payload(BLOCK))])
            if outcome != [None]:
                assert isinstance(outcome[0], OSError) and outcome[0].errno == errno.ENOSPC
                break
            stored.append(key(i))
        else:
            pytest.fail("the disk never filled")
        assert not await store.exists(key(i))
        await store.delete_many(stored[:4])
        assert await store.put_many([(key(100), payload(BLOCK))]) == [None]
        into = buffer(BLOCK)
        await store.get(stored[-1], into)
    finally:
        await store.close()


@pytest.mark.asyncio
async def test_a_batch_that_fills_the_disk_keeps_the_blocks_written_whole(small_disk):
    """A full disk stores what fits, as one file per block would: the entries written whole
    before the write failed are listed and load, the rest fail and give their space back."""
    store = FileBlockStore(small_disk / "tier", FINGERPRINT, 2, direct_io=False, layout="segments")
    await store.open()
    try:
        blocks = [payload(BLOCK, seed=i + 1) for i in range(32)]  # 2 MiB offered to 1 MiB of disk
        outcomes = await store.put_many([(key(i), block) for i, block in enumerate(blocks)])
        kept = next(i for i, outcome in enumerate(outcomes) if outcome is not None)
        assert kept > 0 and all(outcome is None for outcome in outcomes[:kept])
        assert all(isinstance(o, OSError) and o.errno == errno.ENOSPC for o in outcomes[kept:])
        for i in range(kept):
            into = buffer(BLOCK)
            await store.get(key(i), into)
            assert into == blocks[i]
        assert not await store.exists(key(kept))
        free = os.statvfs(small_disk)
        assert free.f_bavail * free.f_frsize < ALIGN + BLOCK  # as many whole entries as fit
    finally:
        await store.close()


@pytest.mark.asyncio
async def test_a_segment_namespace_holds_its_segments_and_no_shard_or_quarantine_directory(tmp_path):
    store = FileBlockStore(tmp_path, FINGERPRINT, 2, layout="segments")
    await store.open()
    try:
        await store.put(key(1), payload(BLOCK))
        assert sorted(path.name for path in store.directory.iterdir()) == ["segments"]
    finally:
        await store.close()


@pytest.mark.asyncio
async def test_undoing_an_open_removes_the_segments_directory_it_made_and_nothing_else(tmp_path):
    earlier = FileBlockStore(tmp_path, FINGERPRINT, 2)  # one file per block: no segments directory
    await earlier.open()
    await earlier.close()
    store = FileBlockStore(tmp_path, FINGERPRINT, 2, layout="segments")
    await store.open()
    assert (store.directory / "segments").is_dir()
    await store.undo_open()  # an engine whose start failed after this tier opened
    assert not (store.directory / "segments").exists()
    assert (store.directory / "00").is_dir()  # the earlier engine's tree stays


def test_a_faulty_wrapper_passes_the_block_size_to_the_store_it_wraps(tmp_path):
    from tiering.backends import FaultyBlockStore

    store = FaultyBlockStore(FileBlockStore(tmp_path, FINGERPRINT, 2, layout="auto"))
    store.block_bytes = BLOCK  # as the adapter does before opening it
    assert store.inner.block_bytes == BLOCK


def test_a_segment_whose_second_open_fails_is_removed_so_the_next_create_succeeds(tmp_path, monkeypatch):
    """The O_DIRECT descriptor is opened after the file is made; out of descriptors there, the
    half-made file once stayed behind and every later store failed with FileExistsError."""
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    real_open, failures = os.open, [OSError(errno.EMFILE, "Too many open files")]

    def open_once_out_of_descriptors(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT and failures:
            raise failures.pop()
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_once_out_of_descriptors)
    try:
        with pytest.raises(OSError, match="Too many open files"):
            file_segment_io.open_segment(dir_fd, 1, direct=True, create=True)
        assert os.listdir(tmp_path) == []
        segment = file_segment_io.open_segment(dir_fd, 1, direct=False, create=True)  # not FileExistsError
        file_segment_io.close_segment(segment)
    finally:
        os.close(dir_fd)


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.asyncio
async def test_a_tier_of_a_tebibyte_holds_a_bounded_number_of_descriptors(tmp_path):
    """A TiB in 64 MiB segments is 16,384 segments, and each held its descriptors (two with
    O_DIRECT) for good: a soft limit of 1,024 ran out at about 24 GiB, and then every open of
    the process failed. Here each segment holds one small block: the same count of segments,
    in 128 MiB of disk. Writes, reads across all of them, deletes and a restart's recovery
    keep the descriptors under a bound that does not grow with the tier."""
    bound = 2 * (file_segment_fds.MAX_OPEN_SEGMENTS + 1) + 8  # the cache, the active segment, calls in flight
    store = FileBlockStore(tmp_path, FINGERPRINT, 4, direct_io=True, layout="segments")  # two descriptors each
    await store.open()
    before = open_descriptors()
    try:
        log = store._layout
        log.segment_bytes = 1  # a segment per append
        for i in range(16_384):
            assert log.put_many([(key(i), payload(ALIGN, seed=i % 250 + 1))]) == [None]
        assert len(log._segments) == 16_384 and open_descriptors() - before <= bound
        sample = {i: buffer(ALIGN) for i in range(0, 16_384, 61)}
        outcomes = log.get_many([(key(i), into) for i, into in sample.items()])
        assert not any(isinstance(outcome, Exception) for outcome in outcomes)
        assert all(into == payload(ALIGN, seed=i % 250 + 1) for i, into in sample.items())
        log.delete_many([key(i) for i in range(1, 16_384, 7)])
        assert open_descriptors() - before <= bound
    finally:
        await store.close()
    store = FileBlockStore(tmp_path, FINGERPRINT, 4, direct_io=True, layout="segments")
    await store.open()  # recovers every segment
    try:
        assert len(await store.recover()) == 16_384 - len(range(1, 16_384, 7))
        assert open_descriptors() - before <= bound
    finally:
        await store.close()


@pytest.mark.asyncio
async def test_a_segment_left_sparse_is_compacted_so_one_long_lived_block_does_not_keep_it(store_kit):
    """Entries are never rewritten and a segment went only once all its blocks had: one block
    that stays (a system prompt's) kept its whole segment, its descriptors and its file, for
    good. Deletes that leave a segment sparse copy its live entries to the active one."""
    store = await opened(store_kit)
    try:
        log = store._layout
        log.segment_bytes = 16 * (ALIGN + BLOCK)  # 16 blocks a segment
        for batch in range(4):
            assert log.put_many([(key(16 * batch + i), payload(BLOCK, seed=16 * batch + i + 1)) for i in range(16)])
        first = log._map[key(0)].segment
        assert len(log._segments) == 4
        log.delete_many([key(i) for i in range(1, 16)])  # key(0) stays: 1/16 of its segment
        assert first.sequence not in log._segments and not (store.directory / "segments" / first.name).exists()
        assert log._map[key(0)].segment is log._active
        into = buffer(BLOCK)
        await store.get(key(0), into)
        assert into == payload(BLOCK, seed=1)
    finally:
        await store.close()
    store, found = await restarted(store_kit)
    try:
        assert len(found) == 64 - 15 and key(0) in found
        into = buffer(BLOCK)
        await store.get(key(0), into)
        assert into == payload(BLOCK, seed=1)
    finally:
        await store.close()


def test_calls_made_while_the_segments_are_mapped_wait_for_it_and_are_never_hung(tmp_path, engine_factory, monkeypatch):
    """Every store, load and delete waited for the whole mapping inside its call's timeout: a
    listing longer than op_timeout_s (1M entries took 12.75 s) failed the first stores after a
    restart as hung and opened the breaker on a healthy disk."""
    config = {"type": "file", "root_dir": str(tmp_path), "layout": "segments", "op_timeout_s": 0.2}
    config |= {"failure_threshold": 1}
    first = engine_factory(config)
    first.store(0, 1)
    first.close()
    mapping, mapped = threading.Event(), threading.Event()
    real = file_segments.recover

    def slow(*args):
        mapping.set()
        assert mapped.wait(60)
        return real(*args)

    monkeypatch.setattr(file_segments, "recover", slow)
    engine = engine_factory(config, recovered=False)
    assert mapping.wait(60)
    out = engine.manager.prepare_store(keys(2, 3), CTX)
    for k, row in zip(out.keys_to_store, out.store_spec.block_ids, strict=True):
        engine.rows[row] = np.frombuffer(block_bytes(k, ROW), dtype=engine.rows.dtype)
    engine.manager.complete_store(out.keys_to_store, CTX)
    engine.manager.on_schedule_end()  # the cascade's store call waits for the mapping
    time.sleep(5 * 0.2)  # five of its timeouts
    mapped.set()
    engine.settle()
    assert engine.tier.health.healthy and sum(engine.tier.failures.values()) == 0
    assert engine.lookup_until_done(0, 1, 2, 3) == [True] * 4
