import pytest

from tiering.backends import MemoryBlockStore
from tiering.testing import BlockStoreSuite, StoreKit


@pytest.fixture
def store_kit():
    backing: dict = {}

    def make(fingerprint):
        store = MemoryBlockStore(fingerprint)
        store.objects = backing  # a "restart" sees what the previous store left
        return store

    return StoreKit(
        make=make,
        read_raw=lambda store, key: bytes(store.objects[key]),
        write_raw=lambda store, key, raw: store.objects.__setitem__(key, bytearray(raw)),
    )


class TestBlockStoreConformance(BlockStoreSuite):
    """Every test of `tiering.testing.BlockStoreSuite`, on this store."""


def test_rejects_bad_fault_options():
    with pytest.raises(ValueError, match=r"failure_rate within 0\.\.1"):
        MemoryBlockStore(b"\0" * 16, failure_rate=2)
