"""Conformance suites a tier's own tests subclass (needs the ``testing`` extra: pytest and
pytest-asyncio): `BlockStoreSuite` for a `BlockStore`, `TierContractSuite` for any
`SecondaryTierManager`. Every store and tier of this project runs both.

Thread: pytest's. Imports: `tiering` (the public names) and `tiering.tiers`.
"""

from tiering.testing.block_store import BlockStoreSuite, StoreKit
from tiering.testing.tier_contract import TierContractSuite, TierKit

__all__ = ["BlockStoreSuite", "StoreKit", "TierContractSuite", "TierKit"]
