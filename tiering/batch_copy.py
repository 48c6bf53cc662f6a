"""A transfer as one batch of (source pointer, destination pointer, size) copies.

Worker side. A job's pages become three int64 arrays, built with numpy once per job, pages
consecutive on both sides coalesced into one copy (`plan_batch`). A `BatchCopier` submits the
whole batch in one call:

- under CUDA, one driver call per job and direction: vLLM's own ``swap_blocks_batch``
  (`cuMemcpyBatchAsync` on CUDA 12.8 or later) where vLLM is installed, else
  ``cuMemcpyBatchAsync`` through ``cuda-bindings`` (the ``cuda`` extra), else none and the
  handler copies run by run as before (`cuda_copier`);
- on the CPU device, `HostCopier` runs the same arrays with one ``memmove`` per copy, so the
  pointer arithmetic the GPU path uses is exercised on every machine.

A copy of GPU->CPU reads live KV: its source is read in stream order. A CPU->GPU copy reads
rows no stream writes, so the driver may read them in any order (``src_order_any``).

Thread: the handler's (the worker thread, a launcher thread, or the host copy thread).
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

logger = logging.getLogger(__name__)


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


def plan_batch(copies: Sequence[Any], gpu: Sequence[PageLayout], cpu: Sequence[PageLayout], to_cpu: bool) -> CopyBatch:
    """The copies of `copies` (`tiering.cpu_gpu.PageCopy`: GPU block ``gpu_ids[i]`` <-> page
    ``cpu_subs[i]`` of CPU row ``cpu_rows[i]`` of tensor ``tensor_idx``), GPU -> CPU if `to_cpu`
    else CPU -> GPU; pages that follow each other on both sides are one copy."""
    gpu_addrs, cpu_addrs, sizes = [], [], []
    for copy in copies:
        if not len(copy.gpu_ids):
            continue
        g, c = gpu[copy.tensor_idx], cpu[copy.tensor_idx]
        width = g.page_bytes
        gpu_at = g.base + copy.gpu_ids * g.stride
        cpu_at = c.base + copy.cpu_rows * c.stride + copy.cpu_subs * width
        breaks = (gpu_at[1:] != gpu_at[:-1] + width) | (cpu_at[1:] != cpu_at[:-1] + width)
        starts = np.flatnonzero(np.concatenate(([True], breaks)))
        gpu_addrs.append(gpu_at[starts])
        cpu_addrs.append(cpu_at[starts])
        sizes.append(np.diff(np.append(starts, len(gpu_at))) * width)
    if not sizes:
        empty = np.zeros(0, dtype=np.int64)
        return CopyBatch(empty, empty, empty)
    gpu_all, cpu_all = np.concatenate(gpu_addrs), np.concatenate(cpu_addrs)
    src, dst = (gpu_all, cpu_all) if to_cpu else (cpu_all, gpu_all)
    return CopyBatch(src.astype(np.int64), dst.astype(np.int64), np.concatenate(sizes).astype(np.int64))


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


def cuda_copier() -> BatchCopier | None:
    """The best copier this process has under CUDA: vLLM's, then cuda-bindings' (a driver of
    CUDA 12.8 or later), else None (copy run by run)."""
    try:
        from vllm import _custom_ops

        return VllmCopier(_custom_ops.swap_blocks_batch)
    except (ImportError, AttributeError):
        pass
    try:
        from cuda.bindings import driver

        error, version = driver.cuDriverGetVersion()
        if error == driver.CUresult.CUDA_SUCCESS and version >= 12080 and hasattr(driver, "cuMemcpyBatchAsync"):
            return CudaBindingsCopier(driver)
        logger.info("CUDA driver %s has no cuMemcpyBatchAsync: GPU copies run one call per run of pages", version)
    except ImportError:
        logger.info("neither vLLM nor cuda-bindings is installed: GPU copies run one call per run of pages")
    return None
