"""The valkey tier against real redis-server processes on 127.0.0.1: a standalone server and a
3-node cluster started by the fixtures, and servers of a test's own for the faults."""

import pytest

from tiering.backends.valkey import ValkeyBlockStore
from tiering.testing import BlockStoreSuite, StoreKit
from tiering.testing.block_store import FINGERPRINT, key


def valkey_config(target, key_prefix, **extra):
    """The config of a tier on `target` (a ValkeyServer or a ValkeyCluster)."""
    cluster = hasattr(target, "nodes")
    addresses = target.addresses[:1] if cluster else [target.address]
    return {"type": "valkey", "addresses": addresses, "cluster_mode": cluster, "key_prefix": key_prefix, **extra}


@pytest.fixture(params=["standalone", "cluster"])
def valkey_target(request):
    return request.getfixturevalue("valkey_server" if request.param == "standalone" else "valkey_cluster")


def raw_client(target, name):
    """A redis-py client of the node that holds `name`."""
    node = target.primary_of(name) if hasattr(target, "nodes") else target
    return node.admin()


@pytest.fixture
def store_kit(valkey_target, key_prefix):
    config = valkey_config(valkey_target, key_prefix)

    def make(fingerprint):
        return ValkeyBlockStore(
            fingerprint, config["addresses"], cluster_mode=config["cluster_mode"], key_prefix=key_prefix
        )

    def read_raw(store, key):
        name = store.value_name(key)
        return raw_client(valkey_target, name).get(name)

    def write_raw(store, key, raw):
        name = store.value_name(key)
        raw_client(valkey_target, name).set(name, raw)

    return StoreKit(make=make, read_raw=read_raw, write_raw=write_raw)


class TestBlockStoreConformance(BlockStoreSuite):
    """Every test of `tiering.testing.BlockStoreSuite`, on a standalone server and a cluster."""


@pytest.mark.asyncio
async def test_values_are_named_by_prefix_layout_and_key_and_spread_over_slots(store_kit, valkey_cluster, key_prefix):
    store = ValkeyBlockStore(FINGERPRINT, valkey_cluster.addresses[:1], cluster_mode=True, key_prefix=key_prefix)
    await store.open()
    try:
        for i in range(12):
            await store.put(key(i), memoryview(bytearray(64)))
        names = [store.value_name(key(i)) for i in range(12)]
        assert names[0] == f"{key_prefix}:{FINGERPRINT.hex()}:{key(0).hex()}".encode()
        owners = {valkey_cluster.primary_of(name).port for name in names}
        assert len(owners) == 3  # no hash tag: the blocks are spread over every primary
    finally:
        await store.close()
