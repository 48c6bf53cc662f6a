"""Mediums and where blocks sit in them: the load/store specs handed to workers, and the
outputs and events of a manager (named apart from `tiering.spec`, which builds the engine).

Thread: any; specs, outputs and events are values passed from the scheduler to workers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tiering.contract.keys import OffloadKey


class LoadStoreSpec(ABC):
    """Where a worker finds, or puts, the bytes of some blocks."""

    @staticmethod
    @abstractmethod
    def medium() -> str:
        """The medium this spec addresses, for example ``"CPU"`` or ``"GPU"``."""


class BlockIDsLoadStoreSpec(LoadStoreSpec, ABC):
    """A spec that addresses blocks by their index in a medium.

    Attributes:
        block_ids: `np.ndarray` of dtype int64, shape ``(num_blocks,)``.
    """

    def __init__(self, block_ids: Sequence[int] | np.ndarray):
        ids = np.asarray(block_ids, dtype=np.int64)
        self.block_ids = ids if ids.ndim == 1 else ids.reshape(-1)  # (a reshape costs more than the copy)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.block_ids.tolist()!r})"


class CPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """Rows of the primary (CPU) tier, one per offloaded block."""

    @staticmethod
    def medium() -> str:
        return "CPU"


class GPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """GPU blocks of one or more KV groups.

    `block_ids` are ordered by KV group: the first ``group_sizes[0]`` ids belong to group 0,
    and so on. ``block_indices[i]`` is the position, within its request, of group i's first
    GPU block; a worker uses it to start in the middle of an offloaded block when one
    offloaded block spans several GPU blocks.

    Raises:
        ValueError: ``sum(group_sizes) != len(block_ids)`` or
            ``len(block_indices) != len(group_sizes)``.
    """

    def __init__(
        self,
        block_ids: Sequence[int] | np.ndarray,
        group_sizes: Sequence[int],
        block_indices: Sequence[int],
    ):
        super().__init__(block_ids)
        if sum(group_sizes) != len(self.block_ids):
            raise ValueError(f"group_sizes sum to {sum(group_sizes)} but there are {len(self.block_ids)} block ids")
        if len(block_indices) != len(group_sizes):
            raise ValueError(
                f"{len(block_indices)} block_indices for {len(group_sizes)} KV groups; expected one per group"
            )
        self.group_sizes: Sequence[int] = group_sizes
        self.block_indices: Sequence[int] = block_indices

    @staticmethod
    def medium() -> str:
        return "GPU"


@dataclass
class PrepareStoreOutput:
    """What `prepare_store` decided.

    Attributes:
        keys_to_store: the keys the caller must copy, in the order of `store_spec.block_ids`
            (keys already held are left out).
        store_spec: where to copy them.
        evicted_keys: keys dropped to make room.
    """

    keys_to_store: list[OffloadKey]
    store_spec: BlockIDsLoadStoreSpec
    evicted_keys: list[OffloadKey]


STORAGE = "STORAGE"
"""The medium of tiers on disks, object stores and remote memory (vLLM's ``Medium.STORAGE``)."""
LOCAL, REMOTE = "LOCAL", "REMOTE"
"""Where a tier's blocks are against the engine that announces them (vLLM's ``Locality``):
on this machine, or reached over the network (and possibly shared with other engines)."""


@dataclass
class OffloadingEvent:
    """Keys that became loadable in (``removed=False``) or left (``removed=True``) a medium.

    Attributes:
        keys: the blocks, in the order they were stored or removed.
        medium: ``"CPU"`` (the primary tier) or `STORAGE`.
        removed: whether they left the tier.
        locality: `LOCAL` or `REMOTE`; None where the tier does not say.
        ownership: the secondary tier's name, or None for the primary tier.
        removal_expected: whether the tier announces every block of a stored event again when
            it leaves (a router, or vLLM's event tracker, may then keep it until that removal).
    """

    keys: list[OffloadKey]
    medium: str
    removed: bool
    locality: str | None = None
    ownership: str | None = None
    removal_expected: bool = False
