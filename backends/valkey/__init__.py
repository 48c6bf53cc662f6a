"""The ``valkey`` (alias ``redis``) tier: blocks in a shared Valkey or Redis server or cluster,
through valkey-glide (the ``valkey`` extra).

- `store`: `ValkeyBlockStore`, the `BlockStore` (its coroutines), and its config keys;
- `client`: the glide client's configuration, addresses and TLS, and its errors.

Thread: the tier's loop (glide's calls are coroutines). Imports: `tiering.contract`,
`tiering.tiers`, `tiering.errors`, `tiering.options`.
"""

from tiering.backends.valkey.store import ValkeyBlockStore

__all__ = ["ValkeyBlockStore"]
