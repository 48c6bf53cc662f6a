"""Block-store tiers: the `BlockStore` interface a backend implements, and the adapter that
turns any block store into a secondary tier."""

from tiering.blockstore.store import BlockStore
from tiering.blockstore.tier import BlockStoreTier

__all__ = ["BlockStore", "BlockStoreTier"]
