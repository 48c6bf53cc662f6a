import logging
import multiprocessing
import os
import stat

import numpy as np
import pytest

from tests import helpers, region_worker
from tiering import RegionInUseError, SharedOffloadRegion
from tiering.cpu.shared_region import region_path

SPAWN = multiprocessing.get_context("spawn")


@pytest.fixture
def instance_id():
    instance = helpers.region_name()
    yield instance
    leftovers = [name for name in os.listdir("/dev/shm") if instance in name]
    assert leftovers == [], f"files left in /dev/shm: {leftovers}"


@pytest.fixture
def run():
    """Start `target(*args)` in a spawned daemon process; stragglers are killed after the test."""
    procs = []

    def start(target, *args):
        proc = SPAWN.Process(target=target, args=args, daemon=True)
        proc.start()
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join()


def test_scheduler_view_rows_are_page_aligned(instance_id):
    region = SharedOffloadRegion(instance_id, num_blocks=3, cpu_page_size=1000, num_workers=2)
    try:
        assert region.is_creator
        assert (region.row_bytes, region.row_stride) == (2000, 4096)
        assert region.total_size_bytes == 3 * 4096 + 4096 == os.path.getsize(region.path)  # rows, then their states
        assert stat.S_IMODE(os.stat(region.path).st_mode) == 0o600
        view = region.create_kv_memoryview()
        assert view.shape == (3, 2000) and view.strides == (4096, 1)
        rows = np.asarray(view)
        rows[1] = 7
        assert all(addr % 4096 == 0 for addr in (rows[b].ctypes.data for b in range(3)))
    finally:
        region.cleanup()


def test_two_worker_processes_fill_their_slots_of_the_same_rows(instance_id, run):
    num_blocks, page = 5, 3000
    scheduler = SharedOffloadRegion(instance_id, num_blocks, page, num_workers=2)
    barrier = SPAWN.Barrier(3)
    workers = [run(region_worker.fill_slot, instance_id, num_blocks, page, 2, rank, barrier) for rank in (0, 1)]
    try:
        barrier.wait(timeout=30)
        rows = np.asarray(scheduler.create_kv_memoryview())
        for block in range(num_blocks):
            for rank in (0, 1):
                slot = rows[block, rank * page : (rank + 1) * page]
                assert (slot[: page // 2] == rank + 1).all()
                assert (slot[page // 2 :] == block).all()
        barrier.wait(timeout=30)
    finally:
        for worker in workers:
            worker.join(30)
        scheduler.cleanup()
    assert [worker.exitcode for worker in workers] == [0, 0]


def test_exactly_one_of_racing_processes_creates(instance_id, run):
    barrier, creators = SPAWN.Barrier(4), SPAWN.Value("i", 0)
    procs = [run(region_worker.race_to_create, instance_id, rank, barrier, creators) for rank in range(4)]
    for proc in procs:
        proc.join(30)
    assert [proc.exitcode for proc in procs] == [0] * 4
    assert creators.value == 1


def test_leftover_of_a_killed_creator_is_replaced(instance_id, run, caplog):
    proc = run(region_worker.create_and_die, instance_id)
    proc.join(30)
    assert proc.exitcode == -9
    assert region_path(instance_id).exists()  # the crash left the file behind
    with caplog.at_level(logging.WARNING):
        region = SharedOffloadRegion(instance_id, num_blocks=8, cpu_page_size=4096)  # another size
    try:
        assert region.is_creator
        assert os.path.getsize(region.path) == 8 * 4096 + 4096
        assert "removing a leftover region" in caplog.text
    finally:
        region.cleanup()


def test_a_live_region_of_another_size_is_an_error(instance_id):
    live = SharedOffloadRegion(instance_id, num_blocks=4, cpu_page_size=4096)
    try:
        with pytest.raises(ValueError, match=r"is live with 20480 bytes; this engine needs 36864"):
            SharedOffloadRegion(instance_id, num_blocks=8, cpu_page_size=4096, rank=0)
        assert os.path.getsize(live.path) == 4 * 4096 + 4096
    finally:
        live.cleanup()


def test_joiner_shares_bytes_and_only_the_creator_unlinks(instance_id):
    creator = SharedOffloadRegion(instance_id, 2, 4096, num_workers=2)
    joiner = SharedOffloadRegion(instance_id, 2, 4096, num_workers=2, rank=0)
    assert not joiner.is_creator
    joiner.create_next_view(4096)[1] = 42
    assert (np.asarray(creator.create_kv_memoryview())[1, :4096] == 42).all()
    joiner.cleanup()
    joiner.cleanup()
    assert creator.path.exists()  # rank 1 never attached: the name stays for it
    creator.cleanup()
    creator.cleanup()
    assert not creator.path.exists()


def test_the_name_goes_once_every_process_attached_and_the_memory_stays_shared(instance_id):
    scheduler = SharedOffloadRegion(instance_id, 2, 4096, num_workers=2)
    first = SharedOffloadRegion(instance_id, 2, 4096, num_workers=2, rank=0)
    assert scheduler.path.exists()
    last = SharedOffloadRegion(instance_id, 2, 4096, num_workers=2, rank=1)
    assert not scheduler.path.exists()  # nothing left to leak, however the processes end
    last.create_next_view(4096)[1] = 7
    first.create_next_view(4096)[0] = 9
    rows = np.asarray(scheduler.create_kv_memoryview())
    assert (rows[1, 4096:] == 7).all() and (rows[0, :4096] == 9).all()
    for region in (first, last, scheduler):
        region.cleanup()


def test_processes_killed_with_sigkill_leave_nothing_once_all_attached(instance_id, run):
    attached = SPAWN.Semaphore(0)
    procs = [run(region_worker.attach_and_wait, instance_id, 2, rank, attached) for rank in (None, 0, 1)]
    for _ in procs:
        assert attached.acquire(timeout=60)
    for proc in procs:
        proc.kill()
        proc.join(30)
    assert [proc.exitcode for proc in procs] == [-9] * 3
    assert not region_path(instance_id).exists()  # (and the fixture checks /dev/shm)


def test_an_engine_start_sweeps_regions_of_engines_killed_while_starting(instance_id, run):
    proc = run(region_worker.create_and_die, instance_id)  # killed before any worker attached
    proc.join(30)
    assert region_path(instance_id).exists()
    assert region_path(instance_id) in SharedOffloadRegion.remove_stale()  # every id, as a start does
    assert not region_path(instance_id).exists()


def test_next_views_carve_the_slot_without_overlap(instance_id):
    scheduler = SharedOffloadRegion(instance_id, 2, 100, num_workers=2)
    worker = SharedOffloadRegion(instance_id, 2, 100, num_workers=2, rank=1)
    try:
        with pytest.raises(ValueError, match="needs a worker rank"):
            scheduler.create_next_view(10)
        first, second = worker.create_next_view(60), worker.create_next_view(40)
        assert first.shape == (2, 60) and first.dtype == np.int8
        first[:] = 1
        second[:] = 2
        with pytest.raises(ValueError, match="does not fit a slot of 100 bytes"):
            worker.create_next_view(1)
        row = np.asarray(scheduler.create_kv_memoryview())[0]
        assert (row[:100] == 0).all() and (row[100:160] == 1).all() and (row[160:] == 2).all()
    finally:
        worker.cleanup()
        scheduler.cleanup()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_blocks": 0}, "must be positive"),
        ({"cpu_page_size": -1}, "must be positive"),
        ({"num_workers": 2, "rank": 2}, "rank 2 is outside 0..1"),
    ],
)
def test_rejects_bad_sizes(instance_id, kwargs, message):
    args = {"num_blocks": 2, "cpu_page_size": 64, **kwargs}
    with pytest.raises(ValueError, match=message):
        SharedOffloadRegion(instance_id, **args)


def test_unsafe_instance_ids_cannot_escape_the_directory():
    path = region_path("../../etc/passwd\0x")
    assert path.parent == region_path("x").parent
    assert "/" not in path.name and ".." not in path.name


def test_remove_stale_deletes_only_regions_nobody_maps(instance_id, run):
    proc = run(region_worker.create_and_die, instance_id + "-dead")
    proc.join(30)
    live = SharedOffloadRegion(instance_id + "-live", 2, 4096)
    try:
        removed = SharedOffloadRegion.remove_stale(instance_id)
        assert removed == [region_path(instance_id + "-dead")]
        assert live.path.exists() and not removed[0].exists()
    finally:
        live.cleanup()
    with pytest.raises(ValueError, match="must be made of letters"):
        SharedOffloadRegion.remove_stale("../x")


def test_a_second_engine_with_a_live_instance_id_is_refused(instance_id, run):
    first = SharedOffloadRegion(instance_id, 2, 4096)
    try:
        with pytest.raises(RegionInUseError, match=f"instance id '{instance_id}' already has a scheduler attached"):
            SharedOffloadRegion(instance_id, 2, 4096)  # another engine's scheduler, same process
        proc = run(region_worker.attach_as_scheduler, instance_id)  # or another process
        proc.join(30)
        assert proc.exitcode == 3
        assert first.path.exists()
    finally:
        first.cleanup()
    second = SharedOffloadRegion(instance_id, 2, 4096)  # the id is free again once released
    second.cleanup()


def test_each_worker_rank_attaches_once(instance_id):
    scheduler = SharedOffloadRegion(instance_id, 2, 4096, num_workers=3)
    ranks = [SharedOffloadRegion(instance_id, 2, 4096, num_workers=3, rank=r) for r in (0, 1)]
    try:
        with pytest.raises(RegionInUseError, match="already has worker rank 1 attached"):
            SharedOffloadRegion(instance_id, 2, 4096, num_workers=3, rank=1)
    finally:
        for region in [*ranks, scheduler]:
            region.cleanup()


def test_a_region_larger_than_the_free_shared_memory_fails_at_start(instance_id, small_disk):
    with pytest.raises(OSError, match=r"needs 4198400 bytes; .*disk has \d+ free: lower cpu_bytes_to_use"):
        SharedOffloadRegion(instance_id, 1024, 4096, shm_dir=small_disk)
    assert os.listdir(small_disk) == []


def test_the_leak_check_counts_our_regions_and_abandoned_ones_never_another_engines(instance_id, run):
    """The check every test runs afterwards (`tests.helpers.regions_left_behind`)."""
    before = helpers.engine_regions()
    attached = SPAWN.Semaphore(0)
    other = run(region_worker.attach_and_wait, instance_id + "-other", 1, None, attached)  # a live engine
    assert attached.acquire(timeout=60)
    ours = SharedOffloadRegion(instance_id + "-ours", 2, 4096)
    try:
        assert helpers.regions_left_behind(before) == [ours.path]
        other.kill()
        other.join(30)  # its region is abandoned now: a leak the check must see
        assert helpers.regions_left_behind(before) == sorted([ours.path, region_path(instance_id + "-other")])
    finally:
        ours.cleanup()
        SharedOffloadRegion.remove_stale(instance_id)
    assert helpers.regions_left_behind(before) == []
