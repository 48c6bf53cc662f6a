import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tests.helpers import key, keys
from tiering import JobMetadata, JobResult, ReqContext, SecondaryTierFactory, TierConfigError
from tiering.backends import ExampleSecondaryTierManager

VIEW = memoryview(bytearray(64)).cast("B", (4, 16))

OUT_OF_TREE = """
from tiering import SecondaryTierManager

class FancyTier(SecondaryTierManager):
    def __init__(self, offloading_spec, primary_kv_view, tier_type, depth=1):
        super().__init__(offloading_spec, primary_kv_view, tier_type)
        self.depth = depth

    def lookup(self, key, req_context):
        return False

    def submit_store(self, job_metadata):
        pass

    def submit_load(self, job_metadata):
        pass

    def get_finished(self):
        return []

class NotATier:
    pass
"""


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch):
    monkeypatch.setattr(SecondaryTierFactory, "_registry", dict(SecondaryTierFactory._registry))


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    """A module `fancy_tier` on sys.path, advertised by an installed distribution's entry point."""
    (tmp_path / "fancy_tier.py").write_text(OUT_OF_TREE)
    dist_info = tmp_path / "fancy_tier-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: fancy-tier\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text(
        textwrap.dedent(
            """
            [tiering.secondary_tiers]
            fancy = fancy_tier:FancyTier
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_builds_a_registered_type_with_its_options():
    tier = SecondaryTierFactory.create_secondary_tier({"type": "example", "custom_param": 67}, VIEW, None)
    assert isinstance(tier, ExampleSecondaryTierManager)
    assert (tier.tier_type, tier.custom_param) == ("example", 67)


def test_entry_point_tiers_are_discovered(plugin_dir):
    assert "fancy" in SecondaryTierFactory.supported_types()
    tier = SecondaryTierFactory.create_secondary_tier({"type": "fancy", "depth": 3}, VIEW, None)
    assert (type(tier).__name__, tier.tier_type, tier.depth) == ("FancyTier", "fancy", 3)


def test_module_path_loads_an_out_of_tree_class(plugin_dir):
    config = {"type": "mine", "module_path": "fancy_tier", "class_name": "FancyTier"}
    assert type(SecondaryTierFactory.create_secondary_tier(config, VIEW, None)).__name__ == "FancyTier"
    config = {"type": "FancyTier", "module_path": "fancy_tier"}  # class name defaults to the type
    assert SecondaryTierFactory.create_secondary_tier(config, VIEW, None).tier_type == "FancyTier"


def test_register_tier_makes_a_type_available(plugin_dir):
    SecondaryTierFactory.register_tier("fancy2", "fancy_tier", "FancyTier")
    SecondaryTierFactory.register_tier("fancy2", "fancy_tier", "FancyTier")  # same target: fine
    assert SecondaryTierFactory.create_secondary_tier({"type": "fancy2"}, VIEW, None).depth == 1
    with pytest.raises(ValueError, match=r"already registered to fancy_tier\.FancyTier"):
        SecondaryTierFactory.register_tier("fancy2", "elsewhere", "Other")


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"custom_param": 1}, "type: expected a tier type such as 'file'; got None"),
        ({"type": "nvme"}, r"tier type 'nvme': type: unknown tier type; known types: .*example"),
        ({"type": "x", "module_path": "no_such_module_here"}, "type: cannot load no_such_module_here:x"),
        ({"type": "Missing", "module_path": "fancy_tier"}, "type: cannot load fancy_tier:Missing"),
        ({"type": "NotATier", "module_path": "fancy_tier"}, "neither a SecondaryTierManager nor a BlockStore subclass"),
        ({"type": "example", "bucket": "b"}, "bucket: unknown key; expected one of custom_param"),
        ({"type": "example", "name": "a b"}, "name: expected 1-64 letters, digits, '_', '.' or '-'; got 'a b'"),
        ({"type": "example", "name": "cpu"}, "name: 'cpu' names the CPU in stats and reports"),
    ],
)
def test_errors_say_what_is_missing_and_what_is_supported(plugin_dir, config, message):
    with pytest.raises(TierConfigError, match=message):
        SecondaryTierFactory.create_secondary_tier(config, VIEW, None)


def test_every_block_store_option_works_for_every_block_store(tmp_path):
    settings = {"probe_misses": True, "failure_threshold": 2, "batch_bytes": "1MiB", "capacity_bytes": "1MiB"}
    configs = [
        {"type": "memory"},
        {"type": "file", "root_dir": str(tmp_path)},
        {"type": "faulty", "inner": {"type": "memory"}},
    ]
    for config in configs:
        tier = SecondaryTierFactory.create_secondary_tier({**config, **settings, "name": "t"}, VIEW, None)
        try:
            assert (tier.name, tier.settings.probe_misses, tier.settings.failure_threshold) == ("t", True, 2)
            assert (tier.settings.batch_bytes, tier.index.capacity_bytes) == (1 << 20, 1 << 20)
        finally:
            tier.shutdown()


def test_a_store_sets_its_own_defaults_of_the_adapter_settings(tmp_path):
    file_tier = SecondaryTierFactory.create_secondary_tier({"type": "file", "root_dir": str(tmp_path)}, VIEW, None)
    memory_tier = SecondaryTierFactory.create_secondary_tier({"type": "memory"}, VIEW, None)
    try:
        assert (file_tier.settings.max_concurrency, memory_tier.settings.max_concurrency) == (16, 64)
    finally:
        file_tier.shutdown()
        memory_tier.shutdown()


def test_the_engine_core_imports_no_backend():
    code = "import sys, tiering, tiering.tiers.factory, tiering.spec; "
    code += "print(sorted(m for m in sys.modules if 'backends' in m))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def job(job_id, *ids, promotion=False):
    return JobMetadata(job_id, keys(*ids), np.arange(len(ids), dtype=np.int64), promotion, ReqContext("r"))


def test_example_tier_follows_the_seed():
    tier = ExampleSecondaryTierManager(offloading_spec=None, primary_kv_view=VIEW)
    tier.submit_store(job(1, 0, 1))
    assert tier.lookup(key(0), ReqContext("r")) is True
    assert tier.lookup(key(5), ReqContext("r")) is False
    tier.submit_load(job(2, 0, 1, promotion=True))
    tier.submit_load(job(3, 0, 5, promotion=True))
    assert tier.get_finished() == [JobResult(1, True), JobResult(2, True), JobResult(3, False)]
    assert tier.get_finished() == []
    assert tier.get_num_blocks() == 2
    bad = JobMetadata(4, keys(0, 1), np.arange(1), False, ReqContext("r"))
    with pytest.raises(ValueError, match="2 keys but 1 block ids"):
        tier.submit_store(bad)
