"""Block-store tiers: the `BlockStore` interface a backend implements, the settings every
block-store tier takes, and the adapter that turns any block store into a secondary tier.

Modules by thread: `store` (the interface; its coroutines run on the loop), `settings`
(construction), `index` and `tier` (scheduler thread), `worker` (loop thread), `outbox` (the
one hand-off between the two).
"""

from tiering.blockstore.settings import BlockStoreSettings
from tiering.blockstore.store import BlockStore
from tiering.blockstore.tier import BlockStoreTier

__all__ = ["BlockStore", "BlockStoreSettings", "BlockStoreTier"]
