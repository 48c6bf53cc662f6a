"""Which `BatchCopier` a CUDA worker uses: the copy kernel (`tiering.worker.copy_kernel`)
where Triton runs, the copy engines' batch call (`tiering.worker.batch_copy`) where vLLM or
cuda-bindings has one, else none (the handler copies run by run). It sits above both kinds
of copier, so neither imports the other.

Thread: the worker's, once, when its handlers are built.
"""

from __future__ import annotations

import logging

from tiering.worker.batch_copy import BatchCopier, CudaBindingsCopier, VllmCopier
from tiering.worker.copy_kernel import KernelCopier

logger = logging.getLogger(__name__)


def cuda_copier() -> BatchCopier | None:
    """The best copier this process has under CUDA: batches of small copies as one kernel
    launch where Triton is installed (`tiering.worker.copy_kernel`), the others (or all, without
    Triton) through the copy engines: vLLM's ``swap_blocks_batch``, else cuda-bindings'
    ``cuMemcpyBatchAsync`` (a driver of CUDA 12.8 or later); None: no batch call at all
    (copy run by run). The kernel is compiled and run once here, on the current device; where
    that fails (a warning says why) the copy engines take every batch."""
    engines = copy_engine_copier()
    try:
        import triton  # noqa: F401
    except ImportError:
        return engines
    kernel = KernelCopier(engines)
    try:
        kernel.warm_up()
    except Exception as exc:  # Triton's errors have no common base: any failure means "don't use it"
        logger.warning("the copy kernel cannot run here (%r): GPU copies go to the copy engines", exc)
        return engines
    return kernel


def copy_engine_copier() -> BatchCopier | None:
    """vLLM's ``swap_blocks_batch``, else cuda-bindings' ``cuMemcpyBatchAsync``, else None."""
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
