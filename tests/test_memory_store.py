import pytest

from tests.store_conformance import *  # noqa: F403 - the shared conformance suite
from tests.store_conformance import StoreKit
from tiering.backends import MemoryBlockStore


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


def test_rejects_bad_fault_options():
    with pytest.raises(ValueError, match=r"failure_rate within 0\.\.1"):
        MemoryBlockStore(b"\0" * 16, failure_rate=2)
