"""Secondary tiers for the tiering engine, and the block-store interface behind them."""

from tiering.backends.example import ExampleSecondaryTierManager
from tiering.backends.faulty import FaultyBlockStore, FaultyTier
from tiering.backends.file import FileBlockStore, FileTier
from tiering.backends.memory import MemoryBlockStore, MemoryTier
from tiering.blockstore import BlockStore

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
