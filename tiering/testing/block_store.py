"""`BlockStoreSuite`: the conformance tests every `BlockStore` passes.

A backend's test module subclasses it with a `store_kit` fixture returning a `StoreKit`
(how to build the store over one shared backing, and raw access to one stored object's
bytes); pytest then runs every test of the suite against that store::

    class TestMyStore(BlockStoreSuite):
        @pytest.fixture
        def store_kit(self, tmp_path):
            return StoreKit(make=..., read_raw=..., write_raw=...)

Needs pytest and pytest-asyncio (the ``testing`` extra). The tests run on the test's event
loop, as a tier's loop thread would run the store.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass

import anyio
import pytest

from tiering import (
    CorruptObjectError,
    ForgedObjectError,
    ObjectNotFoundError,
    StoreClosedError,
    layout_fingerprint,
    make_offload_key,
)
from tiering.contract.identity import CHECKPOINT, namespace
from tiering.contract.keys import OffloadKey
from tiering.tiers.blockstore import BlockStore
from tiering.tiers.blockstore.generations import (
    MANIFEST_KEY,
    Records,
    manifest_text,
    read_records,
    record_namespace,
)
from tiering.tiers.object_format import (
    SEAL_KEY_ID_AT,
    header_size,
    open_payload,
    restamp_header_sum,
    verify_payload,
)
from tiering.tiers.seal import Seal

FINGERPRINT = layout_fingerprint("conformance")
FOREIGN = layout_fingerprint("another model")
KEY, NEW_KEY, OTHERS_KEY = bytes(range(32)), bytes(range(100, 132)), bytes([7]) * 32  # test secrets


def key(i: int) -> OffloadKey:
    """The key of block number `i` in these tests."""
    return make_offload_key(i.to_bytes(8, "big"), 0)


@dataclass
class StoreKit:
    """make(fingerprint) builds an unopened store over one shared backing; read_raw and
    write_raw give the whole stored object of a key as the backing holds it."""

    make: Callable[[bytes], BlockStore]
    read_raw: Callable[[object, bytes], bytes]
    write_raw: Callable[[object, bytes, bytes], None]


def buffer(size: int) -> memoryview:
    """A zeroed, page-aligned buffer (as primary rows are), so stores can use aligned I/O."""
    return memoryview(mmap.mmap(-1, size))


def payload(size: int, seed: int = 0) -> memoryview:
    data = buffer(size)
    data[:] = os.urandom(size) if seed == 0 else bytes([seed % 256]) * size
    return data


async def read_verified(store, key, into) -> None:
    """What the adapter does: the store reads and checks the header and length, then the
    payload's checksum is checked above it."""
    verify_payload(await store.get(key, into), into)


async def read_opened(store, key, into) -> None:
    """What the adapter does with a tier's seal: the store reads, the payload is checked and
    an encrypted one decrypted above it."""
    open_payload(await store.get(key, into), into, store.seal)


async def opened(kit: StoreKit, fingerprint: bytes = FINGERPRINT, seal: Seal | None = None):
    store = kit.make(fingerprint)
    store.seal = seal
    await store.open()
    return store


def _needs_integrity(kit: StoreKit) -> None:
    if not kit.make(FINGERPRINT).supports_integrity:
        pytest.skip("the store does not declare supports_integrity: its tiers refuse the integrity key")


def _flip_payload_byte(raw: bytes) -> bytes:
    corrupted = bytearray(raw)
    corrupted[-1] ^= 0xFF
    return bytes(corrupted)


def _foreign_layout(raw: bytes) -> bytes:
    corrupted = bytearray(raw)
    corrupted[12:28] = FOREIGN  # the fingerprint field of the header
    return bytes(corrupted)


CORRUPTIONS = {
    "flipped payload byte": _flip_payload_byte,
    "truncated payload": lambda raw: raw[:-1],
    "truncated header": lambda raw: raw[:10],
    "extra bytes": lambda raw: raw + b"\0",
    "bad magic": lambda raw: b"XXXX" + raw[4:],
    "foreign layout": _foreign_layout,
    "another key's object": lambda raw: raw,  # written under key 2, see below
}


class BlockStoreSuite:
    """The tests; subclass it (name the subclass ``Test...``) and give it a ``store_kit``
    fixture. Tests of a feature a store lacks are not skipped: every store has them all."""

    @pytest.mark.asyncio
    @pytest.mark.parametrize("size", [1, 1000, 64 << 10, 2 << 20])
    async def test_round_trip_is_byte_exact(self, store_kit, size):
        store = await opened(store_kit)
        try:
            data = payload(size)
            await store.put(key(1), data)
            into = buffer(size)
            await read_verified(store, key(1), into)
            assert into == data
            assert await store.exists(key(1))
        finally:
            await store.close()

    @pytest.mark.asyncio
    async def test_missing_key(self, store_kit):
        store = await opened(store_kit)
        try:
            assert not await store.exists(key(404))
            with pytest.raises(ObjectNotFoundError):
                await store.get(key(404), buffer(8))
        finally:
            await store.close()

    @pytest.mark.asyncio
    async def test_overwrite_replaces_the_object(self, store_kit):
        store = await opened(store_kit)
        try:
            await store.put(key(1), payload(256, seed=1))
            await store.put(key(1), payload(256, seed=2))
            into = buffer(256)
            await read_verified(store, key(1), into)
            assert bytes(into) == bytes([2]) * 256
        finally:
            await store.close()

    @pytest.mark.asyncio
    async def test_delete_many(self, store_kit):
        store = await opened(store_kit)
        try:
            for i in range(3):
                await store.put(key(i), payload(64))
            await store.delete_many([key(0), key(2), key(99)])  # 99 never existed
            assert [await store.exists(key(i)) for i in range(3)] == [False, True, False]
        finally:
            await store.close()

    @pytest.mark.asyncio
    async def test_concurrent_puts_and_gets(self, store_kit):
        store = await opened(store_kit)
        blocks = {i: payload(4096) for i in range(64)}
        try:
            async with anyio.create_task_group() as tg:
                for i, data in blocks.items():
                    tg.start_soon(store.put, key(i), data)
            reads = {i: buffer(4096) for i in blocks}
            async with anyio.create_task_group() as tg:
                for i, into in reads.items():
                    tg.start_soon(read_verified, store, key(i), into)
            assert all(reads[i] == blocks[i] for i in blocks)
        finally:
            await store.close()

    @pytest.mark.asyncio
    async def test_close_then_use_is_an_error(self, store_kit):
        store = store_kit.make(FINGERPRINT)
        with pytest.raises(StoreClosedError):
            await store.put(key(1), payload(8))
        await store.open()
        await store.close()
        await store.close()
        for use in (store.put(key(1), payload(8)), store.get(key(1), payload(8)), store.exists(key(1))):
            with pytest.raises(StoreClosedError):
                await use

    @pytest.mark.asyncio
    @pytest.mark.parametrize("corruption", CORRUPTIONS)
    async def test_corrupted_objects_are_rejected(self, store_kit, corruption):
        store = await opened(store_kit)
        try:
            await store.put(key(1), payload(1000))
            raw = store_kit.read_raw(store, key(1))
            assert len(raw) == header_size(len(key(1)), store.header_align) + 1000
            target = key(2) if corruption == "another key's object" else key(1)
            store_kit.write_raw(store, target, CORRUPTIONS[corruption](raw))
            with pytest.raises(CorruptObjectError):  # from the store (structure) or from the checksum
                await read_verified(store, target, buffer(1000))
        finally:
            await store.close()

    @pytest.mark.asyncio
    async def test_recover_lists_what_a_previous_store_left(self, store_kit):
        first = await opened(store_kit)
        for i in range(5):
            await first.put(key(i), payload(100 * (i + 1)))
        await first.close()
        second = await opened(store_kit)
        try:
            recovered = dict(await second.recover())
            align = second.header_align
            assert recovered == {key(i): header_size(len(key(i)), align) + 100 * (i + 1) for i in range(5)}
            into = buffer(300)
            await read_verified(second, key(2), into)
        finally:
            await second.close()

    @pytest.mark.asyncio
    async def test_batches_report_each_item(self, store_kit):
        store = await opened(store_kit)
        try:
            blocks = [(key(i), payload(2048)) for i in range(6)]
            assert await store.put_many(blocks) == [None] * 6
            store_kit.write_raw(store, key(4), store_kit.read_raw(store, key(4))[:-1])  # truncated
            reads = [(key(i), buffer(2048)) for i in (0, 9, 4, 5)]
            outcomes = await store.get_many(reads)
            assert isinstance(outcomes[1], ObjectNotFoundError)
            assert isinstance(outcomes[2], CorruptObjectError)
            for outcome, (_, into), (_, data) in (
                (outcomes[0], reads[0], blocks[0]),
                (outcomes[3], reads[3], blocks[5]),
            ):
                verify_payload(outcome, into)
                assert into == data
        finally:
            await store.close()

    @pytest.mark.asyncio
    async def test_exists_many_answers_for_each_key_in_order(self, store_kit):
        store = await opened(store_kit)
        try:
            for i in (1, 3):
                await store.put(key(i), payload(100))
            assert await store.exists_many([key(i) for i in range(5)]) == [False, True, False, True, False]
        finally:
            await store.close()

    @pytest.mark.asyncio
    async def test_remove_namespace_leaves_nothing_to_recover(self, store_kit):
        store = await opened(store_kit)
        try:
            for i in range(3):
                await store.put(key(i), payload(100))
            await store.remove_namespace()
        finally:
            await store.close()
        again = await opened(store_kit)
        try:
            assert await again.recover() == []
            assert not await again.exists(key(1))
        finally:
            await again.close()

    @pytest.mark.asyncio
    async def test_an_identitys_namespace_never_shows_another_identitys_objects(self, store_kit):
        if not store_kit.make(FINGERPRINT).lasting:
            pytest.skip("the store does not last: it holds one engine's objects")
        mine, theirs = await opened(store_kit), await opened(store_kit, FOREIGN)
        try:
            await mine.put(key(1), payload(100))
            assert not await theirs.exists(key(1))
            assert await theirs.exists_many([key(1)]) == [False]
            with pytest.raises(ObjectNotFoundError):
                await theirs.get(key(1), buffer(100))
            assert await theirs.recover() == []
            await theirs.remove_namespace()
            assert await mine.exists(key(1))
        finally:
            await mine.close()
            await theirs.close()

    @pytest.mark.asyncio
    async def test_a_namespace_follows_the_weights_and_the_records_list_the_declared_versions(self, store_kit):
        if not store_kit.make(FINGERPRINT).lasting:
            pytest.skip("the store does not last: it keeps no records")
        made: list[bytes] = []  # the namespaces of blocks each `Records.store` asked for

        def records(identity: bytes, weights: str = CHECKPOINT) -> Records:
            def make(ns: bytes, blocks: bool) -> BlockStore:
                if blocks:
                    made.append(ns)
                return store_kit.make(ns)

            return Records(make, identity, {"model": "conformance"}, weights)

        first, second = records(FINGERPRINT), records(FINGERPRINT, "v2")
        try:
            await first.open()
            await second.open()
            assert first.created and not second.created  # the first wrote the manifest
            first.store(), second.store()  # the checkpoint's weights, and v2
            for each, weights in ((first, "v2"), (second, None)):  # resets: to the second one's, to none declared
                await (await each.open_next(weights, 30.0)).close()
            checkpoint, v2, first_after, own = made
            assert first_after == v2 == namespace(FINGERPRINT, "v2")  # replicas on one version share
            assert checkpoint == namespace(FINGERPRINT, CHECKPOINT) != v2
            assert own not in (checkpoint, v2) and not second.shared  # an engine's own: nobody else's
            listed = store_kit.make(record_namespace(FINGERPRINT)).for_records()
            await listed.open()
            try:
                assert (await read_records(listed))[1] == ["v2"]  # the checkpoint's and an engine's own: not listed
            finally:
                await listed.close()
        finally:
            for each in (first, second):
                await each.close()
        # records whose manifest names another identity than the one their namespace is of: a
        # label, never a gate (anyone who can write the store could plant one): written again
        planted = store_kit.make(record_namespace(FOREIGN)).for_records()
        await planted.open()
        try:
            await planted.put(MANIFEST_KEY, memoryview(manifest_text({"identity": FINGERPRINT.hex()})))
        finally:
            await planted.close()
        for rewritten in (1, 0):  # the first open writes its own manifest over it; the next finds it
            foreign = records(FOREIGN)
            try:
                await foreign.open()
                assert foreign.rewritten == rewritten and not foreign.created
            finally:
                await foreign.close()

    @pytest.mark.asyncio
    @pytest.mark.parametrize("encrypt", [False, True], ids=["signed", "encrypted"])
    async def test_sealed_objects_round_trip_and_open_under_a_rotated_key_list(self, store_kit, encrypt):
        _needs_integrity(store_kit)
        writer = await opened(store_kit, seal=Seal([KEY], encrypt))
        data = payload(64 << 10)
        try:
            await writer.put(key(1), data)
            into = buffer(64 << 10)
            await read_opened(writer, key(1), into)
            assert into == data
            raw = store_kit.read_raw(writer, key(1))
            assert (bytes(data[:256]) in raw) is not encrypt  # encrypted: the payload is nowhere in clear
        finally:
            await writer.close()
        rotated = await opened(store_kit, seal=Seal([NEW_KEY, KEY]))  # seals with the new key, opens both
        try:
            into = buffer(64 << 10)
            await read_opened(rotated, key(1), into)
            assert into == data
        finally:
            await rotated.close()

    @pytest.mark.asyncio
    async def test_objects_the_seal_does_not_open_are_never_loaded(self, store_kit):
        """Engines of other keys (and of none) stored into the same backing, one after the
        other: a store may be one engine's at a time (the file tier's segments). A store that
        checks headers at recovery may reclaim these (a namespace is one deployment's);
        either way they are never loaded."""
        _needs_integrity(store_kit)
        for seal, i in ((Seal([OTHERS_KEY]), 1), (None, 2)):
            planter = await opened(store_kit, seal=seal)
            await planter.put(key(i), payload(1000, seed=i))
            await planter.close()
        reader = await opened(store_kit, seal=Seal([KEY]))
        try:
            await reader.recover()
            await reader.put(key(3), payload(1000, seed=3))
            for i in (1, 2):  # (what the store read into the buffer is garbage: the load fails)
                with pytest.raises((ForgedObjectError, ObjectNotFoundError)):  # found forged, or reclaimed
                    await read_opened(reader, key(i), buffer(1000))
        finally:
            await reader.close()
        unsigned = await opened(store_kit)
        try:
            await unsigned.recover()
            with pytest.raises(
                (ForgedObjectError, ObjectNotFoundError)
            ):  # and the other way: sealed, read without keys
                await read_opened(unsigned, key(3), buffer(1000))
        finally:
            await unsigned.close()

    @pytest.mark.asyncio
    @pytest.mark.parametrize("encrypt", [False, True], ids=["signed", "encrypted"])
    @pytest.mark.parametrize("tamper", ["payload byte", "replayed under another key", "key id"])
    async def test_a_tampered_sealed_object_is_forged(self, store_kit, encrypt, tamper):
        _needs_integrity(store_kit)
        store = await opened(store_kit, seal=Seal([KEY, NEW_KEY], encrypt))
        try:
            await store.put(key(1), payload(1000))
            raw = bytearray(store_kit.read_raw(store, key(1)))
            target = key(1)
            if tamper == "payload byte":
                raw[-1] ^= 0x01
            elif tamper == "key id":  # another of the tier's keys: its tag will not match
                raw[SEAL_KEY_ID_AT : SEAL_KEY_ID_AT + 4] = Seal([NEW_KEY]).key_id
            else:  # a genuine object copied under another key, the key in its header changed to match
                at = bytes(raw).index(key(1))
                raw[at : at + len(key(2))], target = key(2), key(2)
            restamp_header_sum(raw)  # a tamperer who knows the format: only the seal can tell
            store_kit.write_raw(store, target, bytes(raw))
            with pytest.raises(ForgedObjectError):
                await read_opened(store, target, buffer(1000))
        finally:
            await store.close()
