"""The built-in secondary tiers, installed as ``tiering.backends``.

Each is registered by entry point (group ``tiering.secondary_tiers``, see pyproject.toml),
like any third party's tier: ``example`` (the reference tier of the contract), and the
block stores ``memory``, ``file``, ``s3`` (needs the ``s3`` extra) and ``faulty``.

Thread: see each module.
"""

from tiering.backends.example import ExampleSecondaryTierManager
from tiering.backends.faulty import FaultyBlockStore
from tiering.backends.file import FileBlockStore
from tiering.backends.memory import MemoryBlockStore

__all__ = ["ExampleSecondaryTierManager", "FaultyBlockStore", "FileBlockStore", "MemoryBlockStore"]
