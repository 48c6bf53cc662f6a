"""What a transfer is and which pages it copies: `TransferResult`, the `OffloadingHandler`
interface, and the plan of a job (`PageCopy`: a tensor's GPU blocks and their pages in CPU
rows), its runs of consecutive pages and its page layouts.

Thread: the worker's (plain functions and data).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tiering.contract.mediums import CPULoadStoreSpec, GPULoadStoreSpec, LoadStoreSpec
from tiering.worker.batch_copy import PageLayout

logger = logging.getLogger(__name__)

TransferType = tuple[str, str]


@dataclass
class TransferResult:
    """A finished transfer: ``transfer_size`` in bytes, ``transfer_time`` in seconds,
    ``transfer_type`` ``("GPU", "CPU")`` for a store or ``("CPU", "GPU")`` for a load.
    ``failed_block_ids``: GPU blocks a load left unwritten: those of rows whose promotion
    failed (see the module docstring), or every block of a load that failed itself (its copy
    raised: ``success`` False); empty for a store. A store that failed marks its CPU rows
    ``FAILED`` (`tiering.cpu.row_states`), so that the CPU tier never keeps or loads them.
    ``wait_time``: the seconds of a load (part of ``transfer_time``) spent waiting for rows
    still being promoted."""

    job_id: int
    success: bool
    transfer_size: int
    transfer_time: float
    transfer_type: TransferType
    failed_block_ids: tuple[int, ...] = ()
    wait_time: float = 0.0


class OffloadingHandler(ABC):
    """Moves blocks between two media asynchronously."""

    @abstractmethod
    def transfer_async(self, job_id: int, spec: tuple[LoadStoreSpec, LoadStoreSpec]) -> bool:
        """Start moving (source spec, destination spec); False if the spec is unusable."""

    @abstractmethod
    def get_finished(self) -> list[TransferResult]:
        """Transfers finished since the last call, in submission order; never blocks."""

    @abstractmethod
    def wait(self, job_ids: Collection[int]) -> None:
        """Block until the given transfers have finished (for preemption)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Finish what is in flight and release streams and threads; idempotent."""


@dataclass
class PageCopy:
    """Pages of one tensor to move: GPU block ``gpu_ids[i]`` <-> page ``cpu_subs[i]`` of CPU
    row ``cpu_rows[i]`` (int64 numpy arrays of one length)."""

    tensor_idx: int
    gpu_ids: np.ndarray
    cpu_rows: np.ndarray
    cpu_subs: np.ndarray


def plan_copies(
    gpu_spec: GPULoadStoreSpec, cpu_spec: CPULoadStoreSpec, factor: int, group_tensors: Sequence[Sequence[int]]
) -> list[PageCopy]:
    """Map GPU blocks to (CPU row, page) for every tensor of every group of the spec.

    Group g has ``group_sizes[g]`` GPU blocks, logically contiguous from position
    ``block_indices[g]`` of its request; position p lives in page ``p % factor`` of the
    group's ``p // factor - block_indices[g] // factor``-th CPU block. CPU block ids are
    listed group after group.

    Raises:
        ValueError: the CPU spec has not exactly the blocks the GPU spec needs, or a group
            index is out of range.
    """
    gpu_ids = np.asarray(gpu_spec.block_ids, dtype=np.int64)
    cpu_ids = np.asarray(cpu_spec.block_ids, dtype=np.int64)
    sizes = list(gpu_spec.group_sizes) if gpu_spec.group_sizes is not None else [len(gpu_ids)]
    firsts = list(gpu_spec.block_indices) if gpu_spec.block_indices is not None else [0] * len(sizes)
    if len(sizes) > len(group_tensors):
        raise ValueError(f"spec has {len(sizes)} KV groups; the cache has {len(group_tensors)}")
    copies, gpu_at, cpu_at = [], 0, 0
    for group, (size, first) in enumerate(zip(sizes, firsts, strict=True)):
        skip = first % factor
        positions = np.arange(skip, skip + size, dtype=np.int64)
        num_cpu = -(-(skip + size) // factor) if size else 0
        group_cpu = cpu_ids[cpu_at : cpu_at + num_cpu]
        if len(group_cpu) != num_cpu:
            raise ValueError(f"group {group} needs {num_cpu} CPU blocks; the CPU spec has {len(cpu_ids) - cpu_at} left")
        rows, subs = group_cpu[positions // factor], positions % factor
        for tensor_idx in group_tensors[group]:
            copies.append(PageCopy(tensor_idx, gpu_ids[gpu_at : gpu_at + size], rows, subs))
        gpu_at, cpu_at = gpu_at + size, cpu_at + num_cpu
    if cpu_at != len(cpu_ids):
        raise ValueError(f"the CPU spec has {len(cpu_ids)} blocks; the GPU spec needs {cpu_at}")
    return copies


def split_rows(copies: list[PageCopy], rows: np.ndarray) -> tuple[list[PageCopy], list[PageCopy]]:
    """The pages of `copies` in CPU rows `rows`, and the others (one `PageCopy` per tensor
    in each, possibly empty)."""
    inside: list[PageCopy] = []
    outside: list[PageCopy] = []
    for copy in copies:
        mask = np.isin(copy.cpu_rows, rows)
        for part, keep in ((inside, mask), (outside, ~mask)):
            part.append(PageCopy(copy.tensor_idx, copy.gpu_ids[keep], copy.cpu_rows[keep], copy.cpu_subs[keep]))
    return inside, outside


def page_layout(pages: Any, page_bytes: int) -> PageLayout:
    """Where the pages of `pages` (a torch tensor or numpy array, int8, one page or one row
    per index of its first dimension) live."""
    if isinstance(pages, np.ndarray):
        return PageLayout(pages.ctypes.data, pages.strides[0], page_bytes)
    return PageLayout(pages.data_ptr(), pages.stride(0) * pages.element_size(), page_bytes)


def runs(copy: PageCopy) -> Iterator[tuple[int, int, int, int]]:
    """(first GPU block, CPU row, first page, count) of maximal runs that are consecutive on
    both sides: each run is one contiguous copy."""
    gpu_ids, rows, subs = copy.gpu_ids.tolist(), copy.cpu_rows.tolist(), copy.cpu_subs.tolist()
    start = 0
    for i in range(1, len(gpu_ids) + 1):
        if (
            i == len(gpu_ids)
            or gpu_ids[i] != gpu_ids[i - 1] + 1
            or rows[i] != rows[i - 1]
            or subs[i] != subs[i - 1] + 1
        ):
            yield gpu_ids[start], rows[start], subs[start], i - start
            start = i
