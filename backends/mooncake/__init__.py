"""The ``mooncake`` tier: blocks in a Mooncake Store pool, the DRAM a fleet's engines
contribute, through Mooncake's own client (the ``mooncake`` extra).

- `store`: `MooncakeBlockStore`, the `BlockStore` (its coroutines);
- `client`: the config keys, the client, the threads its blocking calls run on (in a network
  namespace where configured) and the registered staging memory.

Thread: the tier's loop; Mooncake's calls run on the client's threads. Imports:
`tiering.contract`, `tiering.tiers`, `tiering.errors`, `tiering.options`.
"""

from tiering.backends.mooncake.store import MooncakeBlockStore

__all__ = ["MooncakeBlockStore"]
