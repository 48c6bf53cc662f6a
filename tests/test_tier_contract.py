"""The tier contract (`tiering.testing.TierContractSuite`) on every tier type of the project;
the third-party example runs it in test_third_party_tier.py."""

import pytest

from tiering import SecondaryTierFactory
from tiering.testing import TierContractSuite, TierKit
from tiering.testing.tier_contract import key
from tiering.tiers.object_format import object_size


def kit(config, header_align=64, bounded=True, copies_bytes=True):
    def make(rows, capacity_blocks):
        options = dict(config)
        if capacity_blocks is not None:
            per_block = object_size(len(key(0)), rows.shape[1], header_align)
            options["capacity_bytes"] = capacity_blocks * per_block
        return SecondaryTierFactory.create_secondary_tier(options, rows, None)

    return TierKit(make, bounded=bounded, copies_bytes=copies_bytes)


TIER_TYPES = ["memory", "file-direct", "file-buffered", "faulty", "s3", "valkey", "valkey-cluster", "example"]


@pytest.fixture(params=TIER_TYPES)
def tier_kit(request, tmp_path):
    match request.param:
        case "memory":
            return kit({"type": "memory"})
        case "file-direct" | "file-buffered":
            config = {"type": "file", "root_dir": str(tmp_path), "direct_io": request.param == "file-direct"}
            return kit(config, header_align=4096)
        case "faulty":
            rates = {"failure_rate": 0, "corruption_rate": 0, "hang_rate": 0, "latency_s": 0}
            return kit({"type": "faulty", "inner": {"type": "memory"}, **rates})
        case "s3":
            server, bucket = request.getfixturevalue("s3_server"), request.getfixturevalue("s3_bucket")
            return kit({"type": "s3", "bucket": bucket, "endpoint_url": server.endpoint_url})
        case "valkey" | "valkey-cluster":  # the server evicts: the tier has no capacity of its own
            cluster = request.param == "valkey-cluster"
            target = request.getfixturevalue("valkey_cluster" if cluster else "valkey_server")
            addresses = target.addresses if cluster else [target.address]
            config = {"type": "valkey", "addresses": addresses, "cluster_mode": cluster}
            return kit({**config, "key_prefix": request.getfixturevalue("key_prefix")}, bounded=False)
        case "example":
            return kit({"type": "example"}, bounded=False, copies_bytes=False)


class TestEveryTier(TierContractSuite):
    """Every test of the suite, on each tier type above."""
