"""An asyncio-native KV-cache tiering engine: a CPU primary tier with secondary tiers.

See docs/architecture.md for the layout, the threads and the error tree; every public name is
re-exported here. The worker-side
names (canonical KV caches, transfer handlers) need torch, an optional dependency: they
are imported on first use.
"""

import importlib
from importlib.metadata import PackageNotFoundError, version

from tiering.config import TieringConfig, load_config, parse_config
from tiering.contract.keys import (
    OffloadKey,
    OffloadPolicy,
    ReqContext,
    RequestOffloadingContext,
    get_offload_block_hash,
    get_offload_group_idx,
    make_offload_key,
)
from tiering.contract.mediums import (
    BlockIDsLoadStoreSpec,
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingEvent,
    PrepareStoreOutput,
)
from tiering.contract.offloading import OffloadingManager
from tiering.cpu.manager import CPUOffloadingManager
from tiering.cpu.primary import CPUPrimaryTierOffloadingManager
from tiering.cpu.shared_region import SharedOffloadRegion
from tiering.engine.manager import TieringOffloadingManager
from tiering.errors import (
    ConfigError,
    CorruptObjectError,
    ForgedObjectError,
    ObjectNotFoundError,
    RegionInUseError,
    RuntimeClosedError,
    RuntimeDeadError,
    StoreClosedError,
    TierConfigError,
    TieringError,
    UnusableObjectError,
)
from tiering.eviction.policies import (
    ARCCachePolicy,
    CachePolicy,
    LRUCachePolicy,
    make_cache_policy,
    register_cache_policy,
)
from tiering.spec import KVLayout, TieringOffloadingSpec
from tiering.tiers.base import Doorbell, JobId, JobMetadata, JobResult, SecondaryTierManager
from tiering.tiers.blockstore import BlockStore, BlockStoreSettings, BlockStoreTier
from tiering.tiers.context import TierContext
from tiering.tiers.factory import SecondaryTierFactory
from tiering.tiers.object_format import layout_fingerprint
from tiering.tiers.runtime import AsyncRuntime

try:
    __version__ = version("kv-tiering")
except PackageNotFoundError:  # imported from a checkout that was not installed
    __version__ = "0+unknown"

__all__ = [
    "ARCCachePolicy",
    "AsyncRuntime",
    "BlockIDsLoadStoreSpec",
    "BlockStore",
    "BlockStoreSettings",
    "BlockStoreTier",
    "CPULoadStoreSpec",
    "CPUOffloadingManager",
    "CPUPrimaryTierOffloadingManager",
    "CachePolicy",
    "CanonicalKVCacheRef",
    "CanonicalKVCacheTensor",
    "CanonicalKVCaches",
    "ConfigError",
    "CorruptObjectError",
    "CpuGpuOffloadingHandlers",
    "Doorbell",
    "ForgedObjectError",
    "GPULoadStoreSpec",
    "JobId",
    "JobMetadata",
    "JobResult",
    "KVLayout",
    "LRUCachePolicy",
    "LoadStoreSpec",
    "ObjectNotFoundError",
    "OffloadKey",
    "OffloadPolicy",
    "OffloadingEvent",
    "OffloadingHandler",
    "OffloadingManager",
    "PrepareStoreOutput",
    "RegionInUseError",
    "ReqContext",
    "RequestOffloadingContext",
    "RuntimeClosedError",
    "RuntimeDeadError",
    "SecondaryTierFactory",
    "SecondaryTierManager",
    "SharedOffloadRegion",
    "StoreClosedError",
    "TierConfigError",
    "TierContext",
    "TieringConfig",
    "TieringError",
    "TieringOffloadingManager",
    "TieringOffloadingSpec",
    "TransferResult",
    "UnusableObjectError",
    "canonicalize_kv_caches",
    "get_offload_block_hash",
    "get_offload_group_idx",
    "layout_fingerprint",
    "load_config",
    "make_cache_policy",
    "make_offload_key",
    "parse_config",
    "register_cache_policy",
]

_TORCH_NAMES = {
    "CanonicalKVCacheRef": "tiering.worker.canonical",
    "CanonicalKVCacheTensor": "tiering.worker.canonical",
    "CanonicalKVCaches": "tiering.worker.canonical",
    "CpuGpuOffloadingHandlers": "tiering.worker.cpu_gpu",
    "OffloadingHandler": "tiering.worker.cpu_gpu",
    "TransferResult": "tiering.worker.cpu_gpu",
    "canonicalize_kv_caches": "tiering.worker.canonical",
}


def __getattr__(name: str):
    """Import the torch-dependent names on first use."""
    if name in _TORCH_NAMES:
        return getattr(importlib.import_module(_TORCH_NAMES[name]), name)
    raise AttributeError(f"module 'tiering' has no attribute {name!r}")
