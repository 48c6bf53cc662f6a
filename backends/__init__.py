"""Secondary tiers for the tiering engine, and the block-store interface behind them."""

from backends.example import ExampleSecondaryTierManager
from backends.faulty import FaultyBlockStore, FaultyTier
from backends.file import FileBlockStore, FileTier
from backends.memory import MemoryBlockStore, MemoryTier
from backends.store import BlockStore

__all__ = [
    "BlockStore",
    "ExampleSecondaryTierManager",
    "FaultyBlockStore",
    "FaultyTier",
    "FileBlockStore",
    "FileTier",
    "MemoryBlockStore",
    "MemoryTier",
]
