"""Functions run in child processes by the shared-region tests (spawned, so importable)."""

import os
import signal

from tiering import SharedOffloadRegion


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


def race_to_create(instance_id, barrier, creators):
    region = SharedOffloadRegion(instance_id, 4, 4096)
    with creators.get_lock():
        creators.value += region.is_creator
    barrier.wait(timeout=30)  # nobody cleans up before everyone has joined
    region.cleanup()


def create_and_die(instance_id):
    SharedOffloadRegion(instance_id, 4, 4096)
    os.kill(os.getpid(), signal.SIGKILL)
