"""Conformance suites a tier's own tests subclass (needs the ``testing`` extra: pytest and
pytest-asyncio): `BlockStoreSuite` for a `BlockStore`, `TierContractSuite` for any
`SecondaryTierManager`. Every store and tier of this project runs both. Beside them, the
real servers tests start for themselves (imported by name, not here): `s3_server`, a local
S3-compatible server (moto's, the ``s3`` and ``testing`` extras), and `valkey_server`,
real ``redis-server`` processes, standalone or a cluster, with a TLS front. The suites are
imported on first use, so the servers (which the benchmarks start too) need no pytest.

Thread: pytest's (the servers: any). Imports: `tiering` (the public names) and
`tiering.tiers`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tiering.testing.block_store import BlockStoreSuite, StoreKit
    from tiering.testing.tier_contract import TierContractSuite, TierKit

_MODULES = {
    "BlockStoreSuite": "block_store",
    "StoreKit": "block_store",
    "TierContractSuite": "tier_contract",
    "TierKit": "tier_contract",
}
__all__ = ["BlockStoreSuite", "StoreKit", "TierContractSuite", "TierKit"]


def __getattr__(name: str) -> Any:
    """A suite or kit, imported from its module on first use (PEP 562).

    Raises:
        AttributeError: `name` is none of `__all__`.
        ModuleNotFoundError: pytest or pytest-asyncio is not installed.
    """
    if name not in _MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULES[name]}"), name)
