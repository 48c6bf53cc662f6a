"""The file tier never leaves root_dir, never loads another user's bytes, and never dies of
one bad object."""

import os
import stat

import pytest

from tests.helpers import CTX, ROW, block_bytes, key, keys
from tiering import ObjectNotFoundError, UnusableObjectError
from tiering.backends import FileBlockStore
from tiering.testing.block_store import FINGERPRINT, payload
from tiering.tiers.object_format import MAX_KEY_BYTES


async def opened_store(root, **options):
    store = FileBlockStore(root, FINGERPRINT, io_threads=2, **options)
    await store.open()
    return store


@pytest.mark.asyncio
@pytest.mark.parametrize("length", [100, 121, 122, 200, MAX_KEY_BYTES])
async def test_keys_up_to_the_format_limit_are_stored_and_recovered(tmp_path, length):
    long_key = bytes(range(256)) * 4
    long_key = long_key[:length]
    store = await opened_store(tmp_path)
    try:
        data = payload(4096)
        await store.put(long_key, data)
        into = memoryview(bytearray(4096))
        assert (await store.get(long_key, into)).key == long_key and into == data
        assert len(store.path(long_key).name) < 255
    finally:
        await store.close()
    reopened = await opened_store(tmp_path)
    try:
        assert [k for k, _ in await reopened.recover()] == [long_key]
    finally:
        await reopened.close()


@pytest.mark.asyncio
async def test_recovery_never_follows_a_symlinked_shard_out_of_root_dir(tmp_path):
    root, outside = tmp_path / "tier", tmp_path / "outside"
    outside.mkdir()
    victims = [outside / "precious.tmp", outside / "not-hex-at-all", outside / ("00" * 20)]
    for victim in victims:
        victim.write_bytes(b"someone else's file")
    store = await opened_store(root)
    await store.put(key(1), payload(4096))
    shard = store.path(key(1)).parent
    await store.close()
    other = shard.with_name("00" if shard.name != "00" else "01")
    os.rmdir(other)
    os.symlink(outside, other)  # a shard directory replaced by a link out of the tree

    reopened = await opened_store(root)
    try:
        assert [k for k, _ in await reopened.recover()] == [key(1)]
        assert all(victim.read_bytes() == b"someone else's file" for victim in victims)
        assert not other.is_symlink() and other.is_dir()  # the link was replaced
        os.rmdir(other)
        os.symlink(outside, other)  # and operations never go through one either: the store
        doomed = [k for k in (key(i) for i in range(2000)) if reopened.path(k).parent == other]
        await reopened.delete_many(doomed)  # keeps using the directory it opened (removed here)
        await reopened.put(doomed[0], payload(4096))  # which it makes again, replacing the link
        assert not other.is_symlink() and reopened.path(doomed[0]).is_file()
        assert all(victim.exists() for victim in victims)
        assert sorted(p.name for p in outside.iterdir()) == sorted(v.name for v in victims)
    finally:
        await reopened.close()


@pytest.mark.asyncio
async def test_root_dir_writable_by_others_is_refused(tmp_path):
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(0o777)  # for example /tmp/kv-file-tier pre-created by someone else
    with pytest.raises(
        PermissionError,
        match=r"shared is writable by group or others \(mode 0777\).*use a directory of its own below it",
    ):
        await opened_store(root)
    root.chmod(0o1777)  # shared by design, as /tmp: nobody is told to chmod it
    with pytest.raises(PermissionError, match=r"\(mode 1777\).*\(the tier creates it 0700\)$"):
        await opened_store(root)


@pytest.mark.asyncio
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another user")
async def test_root_dir_of_another_user_is_refused(tmp_path):
    root = tmp_path / "theirs"
    root.mkdir(mode=0o700)
    os.chown(root, 4242, 4242)
    with pytest.raises(PermissionError, match="theirs belongs to uid 4242, not to this engine's user"):
        await opened_store(root)


@pytest.mark.asyncio
async def test_directories_it_creates_are_private_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        store = await opened_store(tmp_path / "a" / "b" / "root")
        await store.close()
    finally:
        os.umask(old)
    for path in (tmp_path / "a", tmp_path / "a" / "b", store.root_dir, store.directory, store.directory / "7f"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path


def test_an_empty_root_dir_is_refused():
    with pytest.raises(ValueError, match="root_dir must not be empty"):
        FileBlockStore("", FINGERPRINT)


@pytest.mark.asyncio
@pytest.mark.parametrize("squatter", ["directory", "fifo", "symlink"])
async def test_something_else_at_an_objects_path_is_unusable_and_set_aside(tmp_path, squatter):
    target = tmp_path / "target"
    target.write_bytes(b"keep me")
    store = await opened_store(tmp_path / "tier")
    try:
        path = store.path(key(1))
        {"directory": os.mkdir, "fifo": os.mkfifo, "symlink": lambda p: os.symlink(target, p)}[squatter](path)
        with pytest.raises(UnusableObjectError, match=r"not a regular file|symbolic link|Too many levels"):
            await store.get(key(1), memoryview(bytearray(4096)))  # a FIFO never blocks the read
        assert not await store.exists(key(1))
        await store.delete_many([key(1)])
        assert not os.path.lexists(path) and target.read_bytes() == b"keep me"
        if squatter == "directory":
            assert len(os.listdir(store.directory / "quarantine")) == 1
        await store.put(key(1), payload(4096))  # the name is usable again
        await store.get(key(1), memoryview(bytearray(4096)))
    finally:
        await store.close()


@pytest.mark.asyncio
async def test_a_directory_squatting_a_name_does_not_fail_the_put(tmp_path):
    store = await opened_store(tmp_path)
    try:
        os.mkdir(store.path(key(1)))
        await store.put(key(1), payload(4096))
        assert await store.exists(key(1))
        with pytest.raises(ObjectNotFoundError):
            await store.get(key(2), memoryview(bytearray(4096)))
    finally:
        await store.close()


def test_unreadable_objects_are_dropped_without_opening_the_breaker(engine_factory, tmp_path):
    engine = engine_factory({"type": "file", "root_dir": str(tmp_path), "layout": "files"}, num_blocks=8)
    engine.store(*range(8))
    engine.store(*range(8, 16))  # 0..7 now only in the file tier
    store = engine.tier.store
    for i in range(6):  # more bad objects than the breaker's threshold (5)
        os.unlink(store.path(key(i)))
    for i, make in enumerate([os.mkdir, os.mkfifo, lambda p: os.symlink("/etc/hostname", p)] * 2):
        make(store.path(key(i)))
    engine.rows[:] = 0
    for i in range(6):  # one promotion job each
        assert engine.lookup_until_done(i) == [False]
        assert engine.tier.lookup(key(i), CTX) is False  # dropped from the index
    assert engine.tier.failures["load_unusable"] == 6
    assert engine.tier.health.healthy
    assert engine.lookup_until_done(6, 7) == [True, True]
    assert engine.loaded_bytes(6, 7) == [block_bytes(k, ROW) for k in keys(6, 7)]
    assert not any(os.path.lexists(store.path(key(i))) for i in range(6))
    assert os.path.exists("/etc/hostname")
