"""GPU<->CPU transfer handlers: on the CPU device here, on CUDA too wherever it is present."""

import ctypes
import multiprocessing

import numpy as np
import pytest
import torch

from tests import region_worker
from tests.helpers import region_name
from tiering import (
    CpuGpuOffloadingHandlers,
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    SharedOffloadRegion,
    canonicalize_kv_caches,
)
from tiering.worker import batch_copy, copiers, copy_kernel, cpu_gpu, direction, transfers

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")),
]
NUM_GPU_BLOCKS = 12
NUM_CPU_BLOCKS = 6
LAYER_SHAPE = (4, 8)  # per block: 4 heads x 8 values, bfloat16 -> 64-byte pages


class Worker:
    """A worker's KV caches (random bfloat16), its handlers, and the scheduler's view of the rows."""

    def __init__(self, device, factor, layers=2, flash=False, groups=None, copier=None):
        generator = torch.Generator().manual_seed(factor * 10 + layers)
        shape = (2, NUM_GPU_BLOCKS, *LAYER_SHAPE) if flash else (NUM_GPU_BLOCKS, *LAYER_SHAPE)
        self.raw = [torch.randn(shape, generator=generator).to(torch.bfloat16).to(device) for _ in range(layers)]
        self.caches = canonicalize_kv_caches(self.raw, NUM_GPU_BLOCKS, groups)
        self.pages = [entry.tensor for entry in self.caches.tensors]
        self.factor = factor
        slot = sum(factor * pages.shape[1] for pages in self.pages)
        instance = region_name()
        self.scheduler_region = SharedOffloadRegion(instance, NUM_CPU_BLOCKS, slot)
        self.region = SharedOffloadRegion(instance, NUM_CPU_BLOCKS, slot, rank=0)
        self.handlers = CpuGpuOffloadingHandlers(
            self.caches, factor, NUM_CPU_BLOCKS, mmap_region=self.region, copier=copier
        )
        self.rows = np.asarray(self.scheduler_region.create_kv_memoryview())

    def cpu_page(self, tensor_idx, row, sub):
        """Bytes of page `sub` of tensor `tensor_idx` in CPU row `row`, read on the scheduler side."""
        offset = sum(self.factor * pages.shape[1] for pages in self.pages[:tensor_idx])
        width = self.pages[tensor_idx].shape[1]
        start = offset + sub * width
        return self.rows[row, start : start + width].tobytes()

    def gpu_page(self, tensor_idx, block):
        return self.pages[tensor_idx][block].cpu().numpy().tobytes()

    def run(self, handler, job_id, spec):
        assert handler.transfer_async(job_id, spec)
        handler.wait([job_id])
        return handler.get_finished()

    def close(self):
        self.handlers.shutdown()
        self.region.cleanup()
        self.scheduler_region.cleanup()


def has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(params=["runs", "gather"], autouse=True)
def host_copy(request, monkeypatch):
    """The CPU device copies large pages run by run and small ones by index: test both. Under
    CUDA the same two: runs of pages by the copy engines, and pages gathered by the threads of
    one kernel (where Triton is installed)."""
    monkeypatch.setattr(direction, "RUN_PAGE_BYTES", 0 if request.param == "runs" else 1 << 30)
    if request.param == "runs":
        monkeypatch.setattr(cpu_gpu, "cuda_copier", copiers.copy_engine_copier)
    elif has_triton():
        monkeypatch.setattr(cpu_gpu, "cuda_copier", lambda: copy_kernel.KernelCopier(None))
    return request.param


@pytest.fixture
def workers():
    made = []

    def make(*args, **kwargs):
        made.append(Worker(*args, **kwargs))
        return made[-1]

    yield make
    for worker in made:
        worker.close()


def expected_placement(gpu_ids, cpu_ids, factor, first=0):
    """(gpu block, cpu row, page) of each block, by the rule: position p = first + j lives in
    page p % factor of the (p // factor - first // factor)-th CPU block."""
    return [
        (gpu, cpu_ids[(first + j) // factor - first // factor], (first + j) % factor) for j, gpu in enumerate(gpu_ids)
    ]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("factor", "gpu_ids", "cpu_ids"), [(1, [7, 2, 9], [3, 0, 1]), (3, [7, 2, 9, 4, 11, 0], [5, 1])]
)
def test_store_then_load_is_byte_exact(workers, device, factor, gpu_ids, cpu_ids):
    worker = workers(device, factor)
    spec = (GPULoadStoreSpec(gpu_ids, [len(gpu_ids)], [0]), CPULoadStoreSpec(cpu_ids))
    (stored,) = worker.run(worker.handlers.gpu_to_cpu_handler, 1, spec)
    page_bytes = worker.pages[0].shape[1]
    assert (stored.job_id, stored.success, stored.transfer_type) == (1, True, ("GPU", "CPU"))
    assert stored.transfer_size == len(gpu_ids) * page_bytes * len(worker.pages)
    assert stored.transfer_time >= 0
    placement = expected_placement(gpu_ids, cpu_ids, factor)
    for tensor_idx in range(len(worker.pages)):
        for gpu, row, sub in placement:
            assert worker.cpu_page(tensor_idx, row, sub) == worker.gpu_page(tensor_idx, gpu)
    originals = {(t, gpu): worker.gpu_page(t, gpu) for t in range(len(worker.pages)) for gpu in gpu_ids}
    for pages in worker.pages:
        pages.zero_()
    (loaded,) = worker.run(worker.handlers.cpu_to_gpu_handler, 2, (spec[1], spec[0]))
    assert (loaded.success, loaded.transfer_type, loaded.transfer_size) == (True, ("CPU", "GPU"), stored.transfer_size)
    assert all(worker.gpu_page(t, gpu) == data for (t, gpu), data in originals.items())


class CountingCopier:
    """A batch copier that counts its calls (each one driver call under CUDA) and passes the
    batch on: to the device's real copier, or `HostCopier` on the CPU device."""

    def __init__(self, device):
        self.inner = cpu_gpu.cuda_copier() if device == "cuda" else batch_copy.HostCopier()
        self.calls: list[tuple[int, bool]] = []  # (copies in the batch, src_order_any)

    def __call__(self, batch, stream, src_order_any):
        self.calls.append((len(batch.sizes), src_order_any))
        self.inner(batch, stream, src_order_any)


@pytest.mark.parametrize("device", DEVICES)
def test_one_copier_call_per_job_and_direction_whatever_the_number_of_pages(workers, device, host_copy):
    if host_copy == "gather" and device == "cpu":
        pytest.skip("small pages are gathered by index on the CPU device, not copied by pointer")
    copier = CountingCopier(device)
    if copier.inner is None:
        pytest.skip("no batch copy call in this CUDA install")
    worker = workers(device, factor=3, layers=3, copier=copier)
    gpu_ids, cpu_ids = [7, 8, 2, 4, 11, 0, 1, 3, 5], [5, 1, 0]  # 9 pages a tensor, 3 tensors
    spec = (GPULoadStoreSpec(gpu_ids, [9], [0]), CPULoadStoreSpec(cpu_ids))
    originals = {(t, gpu): worker.gpu_page(t, gpu) for t in range(3) for gpu in gpu_ids}
    assert worker.run(worker.handlers.gpu_to_cpu_handler, 1, spec)[0].success
    assert copier.calls == [(3 * 8, False)]  # one call; GPU blocks 7, 8 go to one row, side by side: 8 runs a tensor
    for pages in worker.pages:
        pages.zero_()
    assert worker.run(worker.handlers.cpu_to_gpu_handler, 2, (spec[1], spec[0]))[0].success
    assert copier.calls[1:] == [(3 * 8, True)]  # CPU rows are read in any order
    assert all(worker.gpu_page(t, gpu) == data for (t, gpu), data in originals.items())


def test_plan_batch_coalesces_pages_consecutive_on_both_sides_only():
    gpu = batch_copy.PageLayouts.of([batch_copy.PageLayout(base=1000, stride=64, page_bytes=64)])
    cpu = batch_copy.PageLayouts.of([batch_copy.PageLayout(base=50_000, stride=4096, page_bytes=64)])
    copy = transfers.PageCopy(0, np.array([3, 4, 5, 9]), np.array([1, 1, 2, 2]), np.array([0, 1, 0, 1]))
    batch = batch_copy.plan_batch([copy], gpu, cpu, to_cpu=True)
    assert batch.src.tolist() == [1000 + 3 * 64, 1000 + 5 * 64, 1000 + 9 * 64]
    assert batch.dst.tolist() == [50_000 + 4096, 50_000 + 2 * 4096, 50_000 + 2 * 4096 + 64]
    assert batch.sizes.tolist() == [128, 64, 64]
    strided = batch_copy.PageLayouts.of([batch_copy.PageLayout(base=1000, stride=128, page_bytes=64)])  # no merges
    assert batch_copy.plan_batch([copy], strided, cpu, to_cpu=False).sizes.tolist() == [64] * 4


@pytest.mark.parametrize("device", DEVICES)
def test_a_transfer_can_start_in_the_middle_of_an_offloaded_block(workers, device):
    worker = workers(device, factor=3)
    gpu_ids, cpu_ids, first = [5, 6, 7, 8], [2, 4], 4  # positions 4..7: pages 1, 2 of one block, 0, 1 of the next
    spec = (GPULoadStoreSpec(gpu_ids, [4], [first]), CPULoadStoreSpec(cpu_ids))
    assert worker.run(worker.handlers.gpu_to_cpu_handler, 1, spec)[0].success
    for gpu, row, sub in expected_placement(gpu_ids, cpu_ids, 3, first):
        assert worker.cpu_page(0, row, sub) == worker.gpu_page(0, gpu)
    assert set(worker.cpu_page(0, 2, 0)) == {0}  # the page before the first position is untouched
    assert set(worker.cpu_page(0, 4, 2)) == {0}


@pytest.mark.parametrize("device", DEVICES)
def test_several_groups_touch_only_their_tensors(workers, device):
    worker = workers(device, factor=3, layers=2, groups=[[0], [1]])
    spec = (GPULoadStoreSpec([0, 1, 6, 7, 8], [2, 3], [0, 3]), CPULoadStoreSpec([4, 5]))
    (result,) = worker.run(worker.handlers.gpu_to_cpu_handler, 1, spec)
    assert result.transfer_size == 5 * worker.pages[0].shape[1]  # each group copies its one tensor
    for gpu, row, sub in expected_placement([0, 1], [4], 3):
        assert worker.cpu_page(0, row, sub) == worker.gpu_page(0, gpu)
        assert set(worker.cpu_page(1, row, sub)) == {0}
    for gpu, row, sub in expected_placement([6, 7, 8], [5], 3, first=3):
        assert worker.cpu_page(1, row, sub) == worker.gpu_page(1, gpu)
        assert set(worker.cpu_page(0, row, sub)) == {0}


@pytest.mark.parametrize("device", DEVICES)
def test_flash_attention_layout_is_split_into_k_and_v(workers, device):
    worker = workers(device, factor=1, layers=2, flash=True)
    assert len(worker.pages) == 4
    assert worker.pages[0].data_ptr() == worker.raw[0].data_ptr()  # zero copy
    spec = (GPULoadStoreSpec([3, 4], [2], [0]), CPULoadStoreSpec([0, 1]))
    worker.run(worker.handlers.gpu_to_cpu_handler, 1, spec)
    for layer in range(2):
        for kv in range(2):
            assert (
                worker.cpu_page(2 * layer + kv, 0, 0)
                == worker.raw[layer][kv, 3].cpu().view(torch.int8).numpy().tobytes()
            )


@pytest.mark.parametrize("device", DEVICES)
def test_results_come_once_in_order_and_bad_specs_are_refused(workers, device):
    worker = workers(device, factor=1)
    handler = worker.handlers.gpu_to_cpu_handler
    for job_id in range(5):
        assert handler.transfer_async(job_id, (GPULoadStoreSpec([job_id], [1], [0]), CPULoadStoreSpec([job_id])))
    handler.wait(range(5))
    assert [r.job_id for r in handler.get_finished()] == [0, 1, 2, 3, 4]
    assert handler.get_finished() == []
    assert not handler.transfer_async(9, (CPULoadStoreSpec([0]), GPULoadStoreSpec([0], [1], [0])))  # reversed
    assert not handler.transfer_async(9, (GPULoadStoreSpec([0, 1], [2], [0]), CPULoadStoreSpec([0])))  # too few
    assert not handler.transfer_async(9, (GPULoadStoreSpec([0], [1, 0], [0, 0]), CPULoadStoreSpec([0])))  # groups
    assert handler.get_finished() == []
    worker.handlers.shutdown()
    worker.handlers.shutdown()
    assert not handler.transfer_async(10, (GPULoadStoreSpec([0], [1], [0]), CPULoadStoreSpec([0])))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("built_in", ["inference-mode", "normal-mode"])
def test_inference_tensors_are_stored_and_loaded_whatever_mode_the_caller_is_in(device, built_in):
    """vLLM's model runner works under torch.inference_mode, so its KV caches can be inference
    tensors, which refuse in-place updates outside it; the copy threads run outside it."""
    with torch.inference_mode():
        raw = torch.arange(4 * 16, dtype=torch.int8, device=device).view(4, 16)
    assert raw.is_inference()
    caches = canonicalize_kv_caches([raw], 4)
    mode = torch.inference_mode() if built_in == "inference-mode" else torch.inference_mode(False)
    with mode:
        handlers = CpuGpuOffloadingHandlers(caches, 2, 3)
    try:
        store, load = handlers.gpu_to_cpu_handler, handlers.cpu_to_gpu_handler
        with mode:
            assert store.transfer_async(1, (GPULoadStoreSpec([0, 1, 2, 3], [4], [0]), CPULoadStoreSpec([2, 0])))
            store.wait([1])
        with torch.inference_mode():
            raw.zero_()
        with mode:
            assert load.transfer_async(2, (CPULoadStoreSpec([2, 0]), GPULoadStoreSpec([0, 1, 2, 3], [4], [0])))
            load.wait([2])
        assert [r.success for r in store.get_finished() + load.get_finished()] == [True, True]
        assert raw.flatten().tolist() == list(range(64))
    finally:
        handlers.shutdown()


def test_without_a_region_the_handlers_use_a_private_buffer():
    caches = canonicalize_kv_caches([torch.arange(4 * 16, dtype=torch.int8).view(4, 16)], 4)
    handlers = CpuGpuOffloadingHandlers(caches, 2, 3)
    try:
        store, load = handlers.gpu_to_cpu_handler, handlers.cpu_to_gpu_handler
        assert store.transfer_async(1, (GPULoadStoreSpec([0, 1, 2, 3], [4], [0]), CPULoadStoreSpec([2, 0])))
        store.wait([1])
        caches.tensors[0].tensor.zero_()
        assert load.transfer_async(2, (CPULoadStoreSpec([2, 0]), GPULoadStoreSpec([0, 1, 2, 3], [4], [0])))
        load.wait([2])
        assert [r.success for r in store.get_finished() + load.get_finished()] == [True, True]
        assert caches.tensors[0].tensor.flatten().tolist() == list(range(64))
    finally:
        handlers.shutdown()


def test_two_ranks_fill_their_slots_of_the_same_rows_from_two_processes():
    spawn = multiprocessing.get_context("spawn")
    instance, blocks, page_shape = region_name(), 3, (2, 50)
    page = 2 * 50
    scheduler = SharedOffloadRegion(instance, blocks, page, num_workers=2)
    barrier = spawn.Barrier(3)
    procs = [
        spawn.Process(
            target=region_worker.store_rank_blocks, args=(instance, blocks, page_shape, 2, rank, barrier), daemon=True
        )
        for rank in (0, 1)
    ]
    for proc in procs:
        proc.start()
    try:
        barrier.wait(timeout=60)
        rows = np.asarray(scheduler.create_kv_memoryview())
        for block in range(blocks):
            for rank in (0, 1):
                assert set(rows[block, rank * page : (rank + 1) * page].tolist()) == {16 * (rank + 1) + block}
        barrier.wait(timeout=30)
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
        scheduler.cleanup()
    assert [proc.exitcode for proc in procs] == [0, 0]


def test_canonicalize_shares_storage_and_dedupes_shared_tensors():
    shared = torch.zeros((5, 2, 3), dtype=torch.float16)
    caches = canonicalize_kv_caches([shared, shared, torch.zeros((5, 4))], 5, groups=[[0, 1], [2]])
    assert len(caches.tensors) == 2
    assert caches.tensors[0].tensor.shape == (5, 12) and caches.tensors[0].tensor.dtype == torch.int8
    assert caches.tensors[0].tensor.data_ptr() == shared.data_ptr()
    assert [[r.tensor_idx for r in refs] for refs in caches.group_data_refs] == [[0, 0], [1]]
    with pytest.raises(ValueError, match=r"neither \(num_blocks, \.\.\.\)"):
        canonicalize_kv_caches([torch.zeros((3, 5, 2))], 5)
    with pytest.raises(ValueError, match="not contiguous"):
        canonicalize_kv_caches([torch.zeros((2, 5)).t()], 5)


class FakeDriver:
    """What `CudaBindingsCopier` uses of ``cuda.bindings.driver``, over host memory: the call
    is recorded and its copies done with memmove. `returns_fail_index`: the 12.x binding's
    result shape, ``(error, fail index)``; the 13.x one returns ``(error,)``."""

    class CUresult:
        CUDA_SUCCESS = 0
        CUDA_ERROR_INVALID_VALUE = 1

    class CUmemcpySrcAccessOrder:
        CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = "stream"
        CU_MEMCPY_SRC_ACCESS_ORDER_ANY = "any"

    class CUmemcpyAttributes:
        srcAccessOrder = None

    class CUdeviceptr(int):
        """The binding refuses plain ints for the addresses (seen on an H200, cuda-bindings 13.3)."""

    def __init__(self, returns_fail_index, error=0):
        self.returns_fail_index, self.error = returns_fail_index, error
        self.calls = []

    def cuMemcpyBatchAsync(self, dsts, srcs, sizes, count, attrs, attrs_idxs, num_attrs, stream):
        if not all(isinstance(p, self.CUdeviceptr) for p in (*dsts, *srcs)):
            raise TypeError("Argument 'srcs' is not instance of type (expected list[cydriver.CUdeviceptr,]")
        self.calls.append((count, [a.srcAccessOrder for a in attrs], attrs_idxs, num_attrs, stream))
        for dst, src, size in zip(dsts, srcs, sizes, strict=True):
            ctypes.memmove(dst, src, size)
        return (self.error, 0) if self.returns_fail_index else (self.error,)


@pytest.mark.parametrize("returns_fail_index", [True, False], ids=["cuda-12", "cuda-13"])
def test_the_cuda_bindings_copier_makes_one_batch_call_with_the_right_order(returns_fail_index):
    source = np.arange(256, dtype=np.uint8)
    target = np.zeros(256, dtype=np.uint8)
    at = source.ctypes.data, target.ctypes.data
    batch = batch_copy.CopyBatch(
        np.array([at[0], at[0] + 100], dtype=np.int64),
        np.array([at[1] + 8, at[1] + 200], dtype=np.int64),
        np.array([16, 50], dtype=np.int64),
    )
    driver = FakeDriver(returns_fail_index)
    stream = type("Stream", (), {"cuda_stream": 7})()
    batch_copy.CudaBindingsCopier(driver)(batch, stream, True)
    batch_copy.CudaBindingsCopier(driver)(batch, stream, False)
    assert driver.calls == [(2, ["any"], [0], 1, 7), (2, ["stream"], [0], 1, 7)]
    assert target[8:24].tolist() == list(range(16)) and target[200:250].tolist() == list(range(100, 150))
    assert not target[:8].any() and not target[24:200].any()
    with pytest.raises(RuntimeError, match="cuMemcpyBatchAsync of 2 copies failed"):
        batch_copy.CudaBindingsCopier(FakeDriver(returns_fail_index, error=1))(batch, stream, True)


@pytest.mark.skipif(not has_triton(), reason="needs Triton (installed with CUDA builds of torch, and by vLLM)")
def test_the_copy_kernel_copies_every_chunk_of_every_copy_and_nothing_else(monkeypatch):
    """Triton's interpreter runs the kernel on host memory, the same pointer arithmetic a GPU
    runs: copies shorter than a step, across chunks, and ending mid-chunk."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    copy_kernel._kernel.cache_clear()
    monkeypatch.setattr(copy_kernel, "CHUNK_BYTES", 8 * 512)  # 2 steps of 256 words: fewer interpreted programs
    monkeypatch.setattr(copy_kernel, "_WORDS_PER_STEP", 256)
    source = np.random.default_rng(0).integers(0, 255, 1 << 16, dtype=np.uint8)
    target = np.zeros_like(source)
    s, d = source.ctypes.data, target.ctypes.data
    sizes = [8, 4096, 4096 + 8 * 300, 8 * 3 * 512]  # a word, a chunk, into a second chunk, three chunks
    batch = batch_copy.CopyBatch(
        np.array([s, s + 8192, s + 20_000, s + 40_000], dtype=np.int64),
        np.array([d + 16, d + 1024, d + 12_000, d + 50_000], dtype=np.int64),
        np.array(sizes, dtype=np.int64),
    )
    try:
        table = torch.from_numpy(np.stack([batch.src, batch.dst, batch.sizes]))
        chunks = -(-int(batch.sizes.max()) // copy_kernel.CHUNK_BYTES)
        copy_kernel._kernel()[(4, chunks)](
            table[0], table[1], table[2], copy_kernel.CHUNK_BYTES, copy_kernel._WORDS_PER_STEP
        )
    finally:
        copy_kernel._kernel.cache_clear()
    expected = np.zeros_like(source)
    for src, dst, size in zip(batch.src, batch.dst, batch.sizes, strict=True):
        expected[dst - d : dst - d + size] = source[src - s : src - s + size]
    assert (target == expected).all() and target.any()


def test_the_kernel_copier_takes_small_aligned_batches_and_hands_the_rest_on():
    handed = []
    copier = copy_kernel.KernelCopier(lambda batch, stream, any_order: handed.append(len(batch.sizes)))
    small = batch_copy.CopyBatch(*(np.array([v], dtype=np.int64) for v in (4096, 8192, 32 << 10)))
    large = batch_copy.CopyBatch(*(np.array([v], dtype=np.int64) for v in (4096, 8192, 1 << 20)))
    odd = batch_copy.CopyBatch(*(np.array([v], dtype=np.int64) for v in (4097, 8192, 32 << 10)))
    assert copier.takes(small) and not copier.takes(large) and not copier.takes(odd)
    copier(large, None, True)
    copier(odd, None, True)
    assert handed == [1, 1]
    assert copy_kernel.KernelCopier(None).takes(large)
    with pytest.raises(RuntimeError, match="8-byte aligned"):
        copy_kernel.KernelCopier(None)(odd, None, True)


@pytest.mark.skipif(not torch.cuda.is_available() or not has_triton(), reason="needs a CUDA device and Triton")
def test_under_cuda_the_default_copier_is_the_kernel_compiled_ahead_with_the_engines_behind_it():
    copier = copiers.cuda_copier()
    assert isinstance(copier, copy_kernel.KernelCopier) and copy_kernel._kernel.cache_info().currsize == 1
    large = batch_copy.CopyBatch(*(np.array([v], dtype=np.int64) for v in (4096, 8192, 1 << 20)))
    assert copier.takes(large) is (copiers.copy_engine_copier() is None)
