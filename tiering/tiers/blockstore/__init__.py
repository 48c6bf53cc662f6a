"""Block-store tiers: the `BlockStore` interface a backend implements, the settings every
block-store tier takes, and the adapter that turns any block store into a secondary tier.

Modules by thread: `store` (the interface; its coroutines run on the loop), `settings` and
`opening` (construction), `index`, `existence`, `health` (a circuit breaker per tier),
`counters` and `tier` (scheduler thread), `worker` (loop thread), `outbox` (the one hand-off
between the two).

Imports: `tiering.contract`, `tiering.eviction.retention`, `tiering.cpu.row_states`, the rest
of `tiering.tiers` below it (`base`, `runtime`, `object_format`, `seal`), `tiering.errors`,
`tiering.options`, `tiering.stats`.
"""

from tiering.tiers.blockstore.settings import BlockStoreSettings
from tiering.tiers.blockstore.store import BlockStore
from tiering.tiers.blockstore.tier import BlockStoreTier

__all__ = ["BlockStore", "BlockStoreSettings", "BlockStoreTier"]
