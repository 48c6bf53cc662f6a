"""A transfer as one batch of (source pointer, destination pointer, size) copies.

Worker side. A job's pages become three int64 arrays, built with numpy once per job, pages
consecutive on both sides coalesced into one copy (`plan_batch`). A `BatchCopier` submits the
whole batch in one call:

- under CUDA, one driver call per job and direction: vLLM's own ``swap_blocks_batch``
  (`cuMemcpyBatchAsync` on CUDA 12.8 or later) where vLLM is installed, else
  ``cuMemcpyBatchAsync`` through ``cuda-bindings`` (the ``cuda`` extra), else none and the
  handler copies run by run as before (`tiering.worker.copiers` chooses);
- on the CPU device, `HostCopier` runs the same arrays with one ``memmove`` per copy, so the
  pointer arithmetic the GPU path uses is exercised on every machine.

A copy of GPU->CPU reads live KV: its source is read in stream order. A CPU->GPU copy reads
rows no stream writes, so the driver may read them in any order (``src_order_any``).

Thread: the handler's (the worker thread, a launcher thread, or the host copy thread).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np


@dataclass(frozen=True)
class PageLayout:
    """Where the pages of one tensor live: page ``i`` starts at ``base + i * stride`` bytes
    (a CPU row's pages: ``base + row * stride + sub * page_bytes``); each is `page_bytes` long."""

    base: int
    stride: int
    page_bytes: int


@dataclass(frozen=True)
class CopyBatch:
    """Copies ``src[i] -> dst[i]`` of ``sizes[i]`` bytes (int64 arrays of one length)."""

    src: np.ndarray
    dst: np.ndarray
    sizes: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.sizes.sum())


class BatchCopier(Protocol):
    """Submits a `CopyBatch` in one call: on `stream` (a CUDA stream, or None on the CPU
    device); `src_order_any`: no stream writes the sources meanwhile."""

    def __call__(self, batch: CopyBatch, stream: Any, src_order_any: bool) -> None: ...


@dataclass(frozen=True)
class PageLayouts:
    """The `PageLayout` of every tensor as int64 arrays indexed by tensor (built once per
    handler, so that planning a job is a few numpy operations whatever the tensor count)."""

    base: np.ndarray
    stride: np.ndarray
    page_bytes: np.ndarray

    @classmethod
    def of(cls, layouts: Sequence[PageLayout]) -> PageLayouts:
        """The table of `layouts`, one per tensor in tensor order (addresses and sizes in
        bytes). Any thread; pure."""
        table = np.array([(x.base, x.stride, x.page_bytes) for x in layouts], dtype=np.int64).reshape(-1, 3)
        return cls(table[:, 0].copy(), table[:, 1].copy(), table[:, 2].copy())


_EMPTY = np.zeros(0, dtype=np.int64)


def plan_batch(copies: Sequence[Any], gpu: PageLayouts, cpu: PageLayouts, to_cpu: bool) -> CopyBatch:
    """The copies of `copies` (`tiering.worker.cpu_gpu.PageCopy`: GPU block ``gpu_ids[i]`` <-> page
    ``cpu_subs[i]`` of CPU row ``cpu_rows[i]`` of tensor ``tensor_idx``), GPU -> CPU if `to_cpu`
    else CPU -> GPU; pages of one `PageCopy` that follow each other on both sides are one copy.

    Every page of every tensor in one pass of numpy (a loop per tensor cost 11 us a tensor:
    0.7 ms a job for 64 tensors, more than an H200 takes to move the job's 32 MiB)."""
    copies = [copy for copy in copies if len(copy.gpu_ids)]
    if not copies:
        return CopyBatch(_EMPTY, _EMPTY, _EMPTY)
    lengths = np.fromiter((len(copy.gpu_ids) for copy in copies), dtype=np.int64, count=len(copies))
    tensors = np.repeat(np.fromiter((copy.tensor_idx for copy in copies), dtype=np.int64, count=len(copies)), lengths)
    gpu_ids = np.concatenate([copy.gpu_ids for copy in copies])
    rows = np.concatenate([copy.cpu_rows for copy in copies])
    subs = np.concatenate([copy.cpu_subs for copy in copies])
    width = gpu.page_bytes[tensors]
    gpu_at = gpu.base[tensors] + gpu_ids * gpu.stride[tensors]
    cpu_at = cpu.base[tensors] + rows * cpu.stride[tensors] + subs * width
    starts = np.zeros(len(gpu_at), dtype=bool)
    starts[np.cumsum(lengths) - lengths] = True  # each PageCopy starts a copy
    starts[1:] |= (gpu_at[1:] != gpu_at[:-1] + width[:-1]) | (cpu_at[1:] != cpu_at[:-1] + width[:-1])
    first = np.flatnonzero(starts)
    ends = np.cumsum(np.concatenate(([0], width)))
    sizes = ends[np.append(first[1:], len(gpu_at))] - ends[first]
    src, dst = (gpu_at[first], cpu_at[first]) if to_cpu else (cpu_at[first], gpu_at[first])
    return CopyBatch(src, dst, sizes)


class HostCopier:
    """The CPU device's copier: one ``memmove`` per copy (ctypes releases the GIL for each)."""

    def __call__(self, batch: CopyBatch, stream: Any, src_order_any: bool) -> None:
        """Copy the batch now, on the calling thread (`stream` and `src_order_any` unused).
        The pointers must be valid host addresses: nothing is checked."""
        move = ctypes.memmove
        for src, dst, size in zip(batch.src.tolist(), batch.dst.tolist(), batch.sizes.tolist(), strict=True):
            move(dst, src, size)


class VllmCopier:
    """vLLM's ``swap_blocks_batch``: one driver call on the current (the handler's) stream."""

    def __init__(self, swap_blocks_batch: Any):
        self._swap = swap_blocks_batch

    def __call__(self, batch: CopyBatch, stream: Any, src_order_any: bool) -> None:
        """Enqueue the batch on the current CUDA stream (the caller makes `stream` current);
        raises what vLLM's op raises."""
        import torch

        self._swap(
            torch.from_numpy(batch.src), torch.from_numpy(batch.dst), torch.from_numpy(batch.sizes), src_order_any
        )


class CudaBindingsCopier:
    """``cuMemcpyBatchAsync`` through ``cuda-bindings``, one call per batch. The binding takes
    the addresses as ``CUdeviceptr`` objects, not ints (about 50 us per 1,024 copies to make).
    The 12.x Python binding returns ``(error, fail index)``, the 13.x one ``(error,)``: both
    are read, and a failed call raises."""

    def __init__(self, driver: Any):
        self._driver = driver
        self._orders = {
            True: driver.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_ANY,
            False: driver.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
        }

    def __call__(self, batch: CopyBatch, stream: Any, src_order_any: bool) -> None:
        """Enqueue the batch on `stream` (a `torch.cuda.Stream`).

        Raises:
            RuntimeError: the driver refused the call (its error code in the message).
        """
        driver = self._driver
        attributes = driver.CUmemcpyAttributes()
        attributes.srcAccessOrder = self._orders[src_order_any]
        count = len(batch.sizes)
        pointer = driver.CUdeviceptr
        result = driver.cuMemcpyBatchAsync(
            list(map(pointer, batch.dst.tolist())),
            list(map(pointer, batch.src.tolist())),
            batch.sizes.tolist(),
            count,
            [attributes],
            [0],
            1,
            stream.cuda_stream,
        )
        error = result[0]
        if error != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuMemcpyBatchAsync of {count} copies failed: {error!r}")
