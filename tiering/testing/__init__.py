"""Conformance suites a tier's own tests subclass (needs the ``testing`` extra: pytest and
pytest-asyncio): `BlockStoreSuite` for a `BlockStore`, `TierContractSuite` for any
`SecondaryTierManager`. Every store and tier of this project runs both. Beside them, the
real servers tests start for themselves (imported by name, not here): `s3_server`, a local
S3-compatible server (moto's, the ``s3`` and ``testing`` extras), and `valkey_server`,
real ``redis-server`` processes, standalone or a cluster, with a TLS front.

Thread: pytest's (the servers: any). Imports: `tiering` (the public names) and
`tiering.tiers`.
"""

from tiering.testing.block_store import BlockStoreSuite, StoreKit
from tiering.testing.tier_contract import TierContractSuite, TierKit

__all__ = ["BlockStoreSuite", "StoreKit", "TierContractSuite", "TierKit"]
