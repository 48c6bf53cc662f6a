"""One direction of a worker's copies (GPU -> CPU stores, or CPU -> GPU loads): a FIFO of
transfers on a CUDA stream or a host thread, polled without blocking (see
`tiering.worker.cpu_gpu` for how each device copies).

Thread: the worker's; its own copy thread (CPU device) or launcher thread (CUDA).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Collection, Iterator, Sequence
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from tiering.contract.mediums import CPULoadStoreSpec, GPULoadStoreSpec, LoadStoreSpec
from tiering.cpu import row_states
from tiering.cpu.row_states import PENDING, READY, RowStates
from tiering.worker.batch_copy import BatchCopier, PageLayouts, plan_batch
from tiering.worker.transfers import (
    OffloadingHandler,
    PageCopy,
    TransferResult,
    TransferType,
    page_layout,
    plan_copies,
    runs,
    split_rows,
)

logger = logging.getLogger(__name__)

RUN_PAGE_BYTES = 32 << 10
"""CPU device: pages this large or larger are copied run by run; smaller ones by index."""
GATHER_PAGES = 64
"""CPU device: pages per gather (its temporary, under 2 MiB, stays in cache)."""


class _Awaited(NamedTuple):
    """A load's rows still being promoted, and until when (`time.monotonic`) it waits."""

    rows: np.ndarray
    deadline: float


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


class DirectionHandler(OffloadingHandler):
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
        self._gpu_layout = PageLayouts.of([page_layout(pages, pages.shape[1]) for pages in self._gpu])
        self._cpu_layout = PageLayouts.of(
            [page_layout(pages, gpu.shape[1]) for pages, gpu in zip(self._cpu, self._gpu, strict=True)]
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
        awaited = self._rows_to_wait_for(cpu_spec)
        done: futures.Future[Any]
        if not self._cuda:
            done = self._executor.submit(self._copy_on_host, copies, awaited)
        elif awaited is None and (self._last_deferred is None or self._last_deferred.done()):
            done = futures.Future()
            done.set_result(self._launch_cuda(copies, torch.cuda.current_stream(self._gpu[0].device)))
        else:
            compute = torch.cuda.Event()
            compute.record(torch.cuda.current_stream(self._gpu[0].device))
            done = self._last_deferred = self._launcher.submit(self._launch_when_ready, copies, awaited, compute)
        gpu_ids = np.asarray(gpu_spec.block_ids, dtype=np.int64)
        self._pending.append(_Pending(job_id, nbytes, done, gpu_ids, np.asarray(cpu_spec.block_ids, dtype=np.int64)))
        return True

    def _rows_to_wait_for(self, cpu_spec: CPULoadStoreSpec) -> _Awaited | None:
        """The load's rows if one of them is not ``READY`` now (a promotion still landing,
        or failed), with the deadline of its wait, `row_states.PROMOTION_WAIT_S` from now; else None
        (and always for a store)."""
        if self._row_states is None or self._to_cpu:
            return None
        rows = np.asarray(cpu_spec.block_ids, dtype=np.int64)
        deadline = time.monotonic() + row_states.PROMOTION_WAIT_S
        return _Awaited(rows, deadline) if self._row_states.states[rows].any() else None

    def _copy_as_rows_land(
        self, copies: list[PageCopy], awaited: _Awaited | None, copy: Callable[[list[PageCopy]], None]
    ) -> tuple[tuple[int, ...], float]:
        """`copy` the pages of `copies` in turns, each turn those of the rows whose promotion
        landed since the last (`awaited`: the load's rows and its deadline, None when none
        is waited for: one turn), so that copying overlaps the tier's reads; pages of rows
        whose promotion failed, or had not landed by the deadline, are not copied.

        Returns:
            The GPU blocks those pages were for (sorted, each once), and the seconds waited.
        """
        if awaited is None or self._row_states is None:
            copy(copies)
            return (), 0.0
        rows, deadline = awaited
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

    def _copy_on_host(self, copies: list[PageCopy], awaited: _Awaited | None) -> tuple[float, tuple[int, ...], float]:
        start = time.perf_counter()
        failed, waited = self._copy_as_rows_land(copies, awaited, self._copy_now)
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
            for gpu_first, row, sub_first, count in runs(copy):
                gpu_run = gpu[gpu_first : gpu_first + count]
                cpu_run = cpu[row, sub_first : sub_first + count]
                yield (cpu_run, gpu_run) if self._to_cpu else (gpu_run, cpu_run)

    # -- CUDA ------------------------------------------------------------------------------

    def _launch_cuda(self, copies: list[PageCopy], after: Any, awaited: _Awaited | None = None) -> _Launched:
        """Launch `copies` on this direction's stream once `after` (the compute stream, or an
        event recorded on it) is done there; with `awaited` (rows still being promoted), in
        turns as they land (`_copy_as_rows_land`)."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if isinstance(after, torch.cuda.Event):
            self._stream.wait_event(after)
        else:
            self._stream.wait_stream(after)
        with torch.cuda.stream(self._stream):
            start.record(self._stream)
            failed, waited = self._copy_as_rows_land(copies, awaited, self._copy_on_stream)
            end.record(self._stream)
        return _Launched(start, end, failed, waited)

    def _launch_when_ready(self, copies: list[PageCopy], awaited: _Awaited | None, compute: Any) -> _Launched:
        """On the launcher thread: launch the load as its rows land, on the KV cache's device
        (a new thread's current device is the first GPU)."""
        with torch.cuda.device(self._gpu[0].device):
            return self._launch_cuda(copies, compute, awaited)

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
