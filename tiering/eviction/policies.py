"""The eviction policies of the CPU tier (LRU, ARC, ARC-S), registered by name: importing
this module registers them (`tiering.eviction.base` has the interface and the registry).

Thread: the scheduler thread only, through the CPU tier.
"""

from tiering.eviction.arc import ARCCachePolicy
from tiering.eviction.arc_s import ARCSCachePolicy
from tiering.eviction.base import (
    BlockStatus,
    CachePolicy,
    cache_policy_names,
    make_cache_policy,
    register_cache_policy,
)
from tiering.eviction.lru import LRUCachePolicy

__all__ = [
    "ARCCachePolicy",
    "ARCSCachePolicy",
    "BlockStatus",
    "CachePolicy",
    "LRUCachePolicy",
    "cache_policy_names",
    "make_cache_policy",
    "register_cache_policy",
]
