"""Functions run in child processes by the shared-region tests (spawned, so importable)."""

import os
import signal
from pathlib import Path

from tiering import RegionInUseError, SharedOffloadRegion


def fill_slot(instance_id, num_blocks, page_size, num_workers, rank, barrier):
    """Join as worker `rank` and fill its slot of every row with (rank + 1, block) bytes."""
    region = SharedOffloadRegion(instance_id, num_blocks, page_size, num_workers, rank)
    head = region.create_next_view(page_size // 2)
    tail = region.create_next_view(page_size - page_size // 2)
    for block in range(num_blocks):
        head[block] = rank + 1
        tail[block] = block
    barrier.wait(timeout=30)  # the scheduler reads while every worker still maps the region
    barrier.wait(timeout=30)
    region.cleanup()


def race_to_create(instance_id, rank, barrier, creators):
    region = SharedOffloadRegion(instance_id, 4, 4096, num_workers=4, rank=rank)
    with creators.get_lock():
        creators.value += region.is_creator
    barrier.wait(timeout=30)  # nobody cleans up before everyone has joined
    region.cleanup()


def attach_as_scheduler(instance_id):
    """Exit 3 if the region's scheduler role is taken by a live engine."""
    try:
        SharedOffloadRegion(instance_id, 2, 4096).cleanup()
    except RegionInUseError:
        os._exit(3)


def create_and_die(instance_id):
    SharedOffloadRegion(instance_id, 4, 4096)
    os.kill(os.getpid(), signal.SIGKILL)


def store_rank_blocks(instance_id, num_blocks, page_shape, num_workers, rank, barrier):
    """As worker `rank`: fill a CPU-device KV cache with (rank, block) bytes and store its
    GPU blocks 0..num_blocks-1 into CPU rows 0..num_blocks-1 of the shared region."""
    import torch

    from tiering import CPULoadStoreSpec, GPULoadStoreSpec, canonicalize_kv_caches
    from tiering.worker.cpu_gpu import CpuGpuOffloadingHandlers

    cache = torch.empty((num_blocks, *page_shape), dtype=torch.int8)
    for block in range(num_blocks):
        cache[block] = 16 * (rank + 1) + block
    caches = canonicalize_kv_caches([cache], num_blocks)
    page = caches.tensors[0].page_size_bytes
    region = SharedOffloadRegion(instance_id, num_blocks, page, num_workers, rank)
    handlers = CpuGpuOffloadingHandlers(caches, 1, num_blocks, mmap_region=region)
    ids = list(range(num_blocks))
    assert handlers.gpu_to_cpu_handler.transfer_async(
        rank, (GPULoadStoreSpec(ids, [num_blocks], [0]), CPULoadStoreSpec(ids))
    )
    handlers.gpu_to_cpu_handler.wait([rank])
    (result,) = handlers.gpu_to_cpu_handler.get_finished()
    assert result.success and result.transfer_size == num_blocks * page
    handlers.shutdown()
    barrier.wait(timeout=30)  # the scheduler reads while the region is still mapped
    barrier.wait(timeout=30)
    region.cleanup()


def write_blocks_forever(root_dir, fingerprint, block_bytes):
    """Write blocks through the file store's own write path, in its own namespace, until killed."""
    from tests.helpers import block_bytes as payload_of
    from tests.helpers import key
    from tiering.backends.file import dirs as file_dirs
    from tiering.backends.file import objects as file_io

    namespace = file_dirs.open_namespace(Path(root_dir), fingerprint.hex())
    namespace.make_shards()
    for i in range(1_000_000):
        k = key(i)
        file_io.write_object(namespace, k, memoryview(payload_of(k, block_bytes)), fingerprint, None, False, False)


def attach_and_wait(instance_id, num_workers, rank, attached):
    """Attach as worker `rank` (None: the scheduler side), say so, and wait to be killed."""
    SharedOffloadRegion(instance_id, 2, 4096, num_workers, rank)
    attached.release()
    signal.pause()
