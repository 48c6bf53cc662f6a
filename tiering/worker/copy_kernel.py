"""A pointer batch copied by one GPU kernel launch (Triton), for batches of small copies.

Worker side, CUDA only. The copy engines behind ``cuMemcpyBatchAsync`` pay a fixed cost per
copy: on an H200, 32 KiB pages moved at 0.37x of one large ``copy_`` and 8 KiB pages at
0.04-0.07x, where 128 KiB pages and up reach 0.93x. Here the GPU's own threads move the
bytes instead: program ``(i, j)`` copies chunk ``j`` (`CHUNK_BYTES`) of copy ``i``, reading
and writing host memory through its device mapping (page-locked memory is mapped into the
device's address space under unified addressing), so a batch of any shape is one launch.

`KernelCopier` takes batches whose copies are 8-byte aligned and at most
`KERNEL_MAX_COPY_BYTES` on average; others go to the copy engines (`fallback`).

Thread: the handler's (the worker thread or a launcher thread), with the handler's stream
current.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from tiering.worker.batch_copy import BatchCopier, CopyBatch

CHUNK_BYTES = 64 << 10
"""Bytes one program copies (a loop of `_WORDS_PER_STEP` 8-byte words at a time)."""
_WORDS_PER_STEP = 1024
KERNEL_MAX_COPY_BYTES = 64 << 10
"""Batches whose copies average more than this go to the copy engines. On an H200 the
kernel moved 2 MiB blocks of 32 KiB pages at 0.82-0.87x of one ``copy_`` where the engines
reached 0.64-0.69x; from 128 KiB pages up the engines won (0.94-0.96x against 0.81-0.89x),
without taking the GPU's threads."""


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def copy_words(srcs, dsts, sizes, CHUNK: tl.constexpr, STEP: tl.constexpr):
        i = tl.program_id(0)
        words = (tl.load(sizes + i) - tl.program_id(1) * CHUNK) // 8  # words of copy i from this chunk on
        first = tl.program_id(1) * (CHUNK // 8)
        src = tl.load(srcs + i).to(tl.pointer_type(tl.int64)) + first
        dst = tl.load(dsts + i).to(tl.pointer_type(tl.int64)) + first
        for step in range(0, CHUNK // 8, STEP):
            offsets = step + tl.arange(0, STEP)
            mask = offsets < words
            tl.store(dst + offsets, tl.load(src + offsets, mask=mask), mask=mask)

    return copy_words


class KernelCopier:
    """One kernel launch per batch of small, aligned copies; the rest through `fallback`."""

    def __init__(self, fallback: BatchCopier | None):
        """`fallback`: the copy-engine copier for batches of large copies; None: every
        aligned batch runs here."""
        self._fallback = fallback

    def takes(self, batch: CopyBatch) -> bool:
        """Whether this batch runs as a kernel: every address and size a multiple of 8, and
        (with a fallback) copies of at most `KERNEL_MAX_COPY_BYTES` on average."""
        aligned = not ((batch.src | batch.dst | batch.sizes) & 7).any()
        small = self._fallback is None or batch.nbytes <= KERNEL_MAX_COPY_BYTES * len(batch.sizes)
        return bool(aligned and small)

    def __call__(self, batch: CopyBatch, stream: Any, src_order_any: bool) -> None:
        """Enqueue the batch on the current CUDA stream (the caller makes `stream` current).

        Raises:
            RuntimeError: an unaligned batch and no fallback; or what Triton or the fallback raises.
        """
        if not self.takes(batch):
            if self._fallback is None:
                raise RuntimeError("a kernel copy needs 8-byte aligned addresses and sizes")
            self._fallback(batch, stream, src_order_any)
            return
        _launch(batch)

    def warm_up(self) -> None:
        """Compile the kernel now and run it once (8 bytes within a scratch tensor on the
        current device), so that the first transfer does not wait for Triton's compiler.

        Raises:
            Exception: whatever Triton raises where it cannot build or run the kernel (no C
                compiler, an unsupported GPU): the caller falls back to the copy engines.
        """
        import torch

        scratch = torch.zeros(2, dtype=torch.int64, device=torch.cuda.current_device())
        at = scratch.data_ptr()
        _launch(CopyBatch(*(np.array([v], dtype=np.int64) for v in (at, at + 8, 8))))
        torch.cuda.synchronize()


def _launch(batch: CopyBatch) -> None:
    """Enqueue the kernel for `batch` (8-byte aligned) on the current CUDA stream."""
    import torch

    count = len(batch.sizes)
    width = count + count % 2  # rows of 16-byte aligned starts: one specialization of the kernel
    table = np.zeros((3, width), dtype=np.int64)
    table[0, :count], table[1, :count], table[2, :count] = batch.src, batch.dst, batch.sizes
    on_gpu = torch.from_numpy(table).pin_memory().to(torch.cuda.current_stream().device, non_blocking=True)
    chunks = -(-int(batch.sizes.max()) // CHUNK_BYTES)
    _kernel()[(count, chunks)](on_gpu[0], on_gpu[1], on_gpu[2], CHUNK_BYTES, _WORDS_PER_STEP)
