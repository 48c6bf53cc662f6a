"""`RowRecords`, on private memory: which rows a restarted engine adopts, whatever order the
scheduler's commits, evictions and the sealer's work came in (`tiering.cpu.row_records`)."""

import numpy as np

from tests.helpers import keys
from tiering.cpu.kept_regions import ABANDONED_TTL_S, KEPT_SUFFIX, sweep
from tiering.cpu.row_records import (
    GIL_HELD_BYTES,
    HEADER_BYTES,
    MAX_KEY_BYTES,
    RECORD,
    VERIFY_ROWS_PER_THREAD,
    Geometry,
    RowRecords,
    read_header,
)

ROWS, ROW_BYTES, STRIDE = 8, 48, 64


def records() -> tuple[RowRecords, np.ndarray]:
    """Fresh records over `ROWS` rows of private memory, as a new region's, and the rows."""
    rows = np.zeros((ROWS, STRIDE), dtype=np.int8)
    made = RowRecords(memoryview(bytearray(4096)), np.zeros(ROWS, dtype=RECORD), rows, ROW_BYTES)
    assert made.adopt().keys == []  # a new region: nothing, and every row odd from now on
    return made, rows


def committed(made: RowRecords, rows: np.ndarray, row: int, block: int) -> np.ndarray:
    """Write block `block`'s bytes into `row` and commit it; returns the version queued."""
    rows[row, :ROW_BYTES] = block
    made.commit(keys(block), [row])
    return made.records["version"][[row]].copy()


def test_only_rows_committed_and_sealed_at_their_current_version_are_adopted():
    made, rows = records()
    for row in range(4):
        made.seal(np.array([row]), committed(made, rows, row, 10 + row), keys(10 + row))
    committed(made, rows, 4, 14)  # committed, never sealed
    rows[5, :ROW_BYTES] = 15  # written, never committed
    late = committed(made, rows, 6, 16)
    made.retract([6])  # evicted before the sealer got to it ...
    assert made.seal(np.array([6]), late, keys(16)) == 0  # ... which leaves it unsealed
    made.retract([3])  # evicted after it was sealed
    rows[0, 0] = 99  # a byte changed under a sealed row
    found = made.adopt()
    assert sorted(zip(found.rows, found.keys, strict=True)) == [(1, keys(11)[0]), (2, keys(12)[0])]
    assert (found.unsealed, found.corrupt) == (1, 1)
    assert all(rows[row, 0] == 10 + row for row in found.rows)


def test_a_seal_for_a_version_the_row_left_never_counts_even_once_the_row_is_committed_again():
    made, rows = records()
    first = committed(made, rows, 0, 1)
    made.retract([0])
    second = committed(made, rows, 0, 2)  # the row holds block 2 now
    assert made.seal(np.array([0, 0]), np.concatenate([first, second]), keys(1, 2)) == 1
    found = made.adopt()
    assert (found.rows, found.keys) == ([0], keys(2))


def test_a_key_longer_than_a_record_holds_leaves_its_row_unadopted():
    made, rows = records()
    long_key = bytes(MAX_KEY_BYTES + 1)
    rows[0, :ROW_BYTES] = 1
    made.commit([long_key], [0])
    assert made.seal(np.array([0]), made.records["version"][[0]].copy(), [long_key]) == 0
    assert made.adopt().keys == []


def test_the_header_reads_back_its_geometry_and_digest_and_refuses_another_format():
    geometry = Geometry(ROWS, STRIDE, ROW_BYTES, 2)
    header = read_header(geometry.header(b"d" * 16))
    assert (header.geometry, header.digest) == (geometry, b"d" * 16)
    assert read_header(b"not a header").geometry is None
    assert read_header(b"X" + geometry.header(b"d" * 16)[1:]).geometry is None


def test_rows_checked_by_several_threads_are_adopted_in_order_and_a_changed_one_is_not():
    count, row_bytes = 2 * VERIFY_ROWS_PER_THREAD + 3, GIL_HELD_BYTES + 4096  # a pool of threads checks them
    rows = np.zeros((count, row_bytes), dtype=np.int8)
    made = RowRecords(memoryview(bytearray(4096)), np.zeros(count, dtype=RECORD), rows, row_bytes)
    made.adopt()
    blocks = list(range(count))
    for row in blocks:
        rows[row, :8] = np.frombuffer(row.to_bytes(8, "big"), dtype=np.int8)
    made.commit(keys(*blocks), blocks)
    assert made.seal(np.array(blocks), made.records["version"].copy(), keys(*blocks)) == count
    rows[count - 1, -1] = 1  # the last byte of the last row, changed after its seal
    found = made.adopt()
    assert (found.rows, found.keys, found.corrupt) == (blocks[:-1], keys(*blocks[:-1]), 1)


def test_the_sweep_removes_this_users_abandoned_kept_regions_and_leaves_links_alone(tmp_path):
    header = Geometry(ROWS, STRIDE, ROW_BYTES, 1).header(b"d" * 16, abandoned_at=1.0)  # abandoned long ago
    stale, loose = tmp_path / f"tiering-a-1{KEPT_SUFFIX}", tmp_path / f"tiering-b-2{KEPT_SUFFIX}"
    for path in (stale, loose):
        path.write_bytes(header.ljust(HEADER_BYTES, b"\0"))
    loose.chmod(0o620)  # this user's, writable by others: never adopted, but swept
    target = tmp_path / "kept-elsewhere"
    target.write_bytes(header.ljust(HEADER_BYTES, b"\0"))
    link = tmp_path / f"tiering-c-3{KEPT_SUFFIX}"
    link.symlink_to(target)  # a link someone planted: nothing is done through it
    assert sorted(sweep(tmp_path, now=1.0 + ABANDONED_TTL_S + 1)) == [stale, loose]
    assert link.is_symlink() and target.read_bytes() == header.ljust(HEADER_BYTES, b"\0")
