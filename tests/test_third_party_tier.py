"""A third-party tier package, installed and discovered by entry point, passes the suite."""

import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROW, block_bytes, keys
from tests.store_conformance import *  # noqa: F403 - the shared conformance suite
from tests.store_conformance import StoreKit
from tiering import SecondaryTierFactory

PACKAGE = Path(__file__).parent / "third_party_tier"


@pytest.fixture(scope="module")
def dictstore_tier(tmp_path_factory):
    """The example package, pip-installed into a directory put on sys.path."""
    source = tmp_path_factory.mktemp("source") / "package"
    shutil.copytree(PACKAGE, source)  # builds write next to the sources; keep the repository clean
    target = tmp_path_factory.mktemp("site")
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), str(source)]
    subprocess.run(command, check=True, capture_output=True, timeout=600)
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(target))
        yield importlib.import_module("dictstore_tier")
        sys.modules.pop("dictstore_tier", None)


@pytest.fixture
def store_kit(dictstore_tier):
    backing: dict = {}

    def make(fingerprint):
        store = dictstore_tier.DictStore(fingerprint)
        store.objects = backing  # a "restart" sees what the previous store left
        return store

    def write_raw(store, key, raw):
        store.objects[key] = raw

    return StoreKit(
        make=make,
        read_raw=lambda store, key: store.objects[key],
        write_raw=write_raw,
    )


def test_the_installed_tier_is_found_by_entry_point(dictstore_tier):
    assert "dictstore" in SecondaryTierFactory.supported_types()
    view = memoryview(bytearray(4 * ROW)).cast("B", (4, ROW))
    tier = SecondaryTierFactory.create_secondary_tier({"type": "dictstore", "capacity_bytes": "1MiB"}, view, None)
    try:
        assert isinstance(tier, dictstore_tier.DictStoreTier) and tier.capacity_bytes == 1 << 20
    finally:
        tier.shutdown()
    with pytest.raises(TypeError, match="does not take bucket; it takes: capacity_bytes, max_concurrency"):
        SecondaryTierFactory.create_secondary_tier({"type": "dictstore", "bucket": "b"}, view, None)


def test_the_installed_tier_serves_an_engine(dictstore_tier, engine_factory):
    engine = engine_factory({"type": "dictstore"})
    engine.store(0, 1, 2, 3)
    engine.store(4, 5, 6, 7)
    engine.rows[:] = 0
    assert engine.lookup_until_done(0, 1) == [True, True]
    assert engine.loaded_bytes(0, 1) == [block_bytes(k, ROW) for k in keys(0, 1)]
