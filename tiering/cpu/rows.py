"""`Rows`: the CPU tier's row ids and the holds on rows that hold no block.

A row is free, holds a block (the tier's index and policy know it), or is quarantined: it
holds no block, but I/O outside the caller's control may still use it (a secondary tier's
job that timed out, a job in flight at a reset), one hold per such user. A load may also pin
a promotion's row before the promotion lands (`CPUOffloadingManager.prepare_load`'s
``pending_ok``): its pin counts as a reader once the write lands, and if the write fails the
row is quarantined until that load ends (an orphan), ``FAILED`` in `row_states` meanwhile so
that the load copies nothing from it.

Thread: the scheduler thread only (owned by `CPUOffloadingManager`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from tiering.contract.keys import OffloadKey
from tiering.cpu.row_records import RowRecords
from tiering.cpu.row_states import READY, RowStates
from tiering.eviction.policies import BlockStatus


class Rows:
    """Free, quarantined and early-pinned rows of a tier of `num_rows` rows."""

    def __init__(self, num_rows: int):
        self.num_rows = num_rows
        # Each row's status, made once with the rows (as their memory is): a store allocates
        # nothing per block and gives the garbage collector no new object to track.
        self._statuses = [BlockStatus(row) for row in range(num_rows)]
        self.row_states: RowStates | None = None  # the primary tier's, shared with the workers
        self.records: RowRecords | None = None  # a crash-surviving primary tier's: evicted rows retracted
        self._free: list[int] = []
        self._used = 0  # ids below this were handed out before
        self.quarantined: Counter[int] = Counter()  # row -> holders: a late I/O may still use it
        self.pending_pins: dict[OffloadKey, list[str]] = {}  # a write in flight -> requests pinning it
        self.orphans: dict[tuple[str, OffloadKey], int] = {}  # (request, key) -> row of a failed write it pins

    def allocate(self, n: int) -> tuple[list[int], list[BlockStatus]]:
        """`n` free rows and their statuses, each a write in flight (ref count -1): the most
        recently freed rows first, then rows never used. (vLLM hands out never-used rows
        first. Reusing a row that was just written keeps the tier's touched memory, its page
        faults and its resident set as small as the working set allows, and no row is better
        than another for what it holds.) The caller checks that `n` are free."""
        free, taken = self._free, min(n, len(self._free))
        reused = free[len(free) - taken :]
        del free[len(free) - taken :]
        reused.reverse()
        if taken < n:
            start = self._used
            self._used += n - len(reused)
            reused.extend(range(start, self._used))
        blocks = list(map(self._statuses.__getitem__, reused))
        for block in blocks:
            block.ref_cnt = -1
        return reused, blocks

    def adopt(self, rows: list[int]) -> list[BlockStatus]:
        """Take `rows` (at start, before any is handed out) for blocks a dead engine left in
        them (`tiering.cpu.row_records`): their statuses, idle (ref count 0); every other row
        is free, lowest first."""
        taken = set(rows)
        self._used = self.num_rows
        self._free = [row for row in reversed(range(self.num_rows)) if row not in taken]
        blocks = list(map(self._statuses.__getitem__, rows))
        for block in blocks:
            block.ref_cnt = 0
        return blocks

    def free(self, rows: list[int], evicted: bool = False) -> None:
        """Make `rows` free; a row a failed promotion left ``FAILED`` is ``READY`` again
        (`evicted`: the rows held landed blocks, ``READY`` already)."""
        if rows and not evicted and self.row_states is not None:
            self.row_states.mark(rows, READY)
        if evicted and self.records is not None:
            self.records.retract(rows)
        self._free.extend(rows)

    def quarantine(self, rows: Iterable[int]) -> None:
        """Add a hold on each of `rows` (a row listed twice gets two)."""
        self.quarantined.update(rows)

    def release(self, rows: Iterable[int]) -> None:
        """Release one hold on each of `rows`; a row with no hold left is free again.

        Raises:
            KeyError: a row has no hold (released twice, say).
        """
        quarantined = self.quarantined
        for row in rows:
            if quarantined[row] < 1:  # (a Counter: reading a missing row adds nothing)
                raise KeyError(f"release_rows: row {row} is not quarantined")
            quarantined[row] -= 1
            if not quarantined[row]:
                del quarantined[row]
                self.free([row])

    def pin_early(self, key: OffloadKey, req_id: str) -> None:
        """Request `req_id` pinned `key`'s row while its write is in flight."""
        self.pending_pins.setdefault(key, []).append(req_id)

    def pinned_early(self, key: OffloadKey, req_id: str, writing: bool) -> bool:
        """Whether request `req_id` pinned `key` early and has not released it: its write is
        still in flight (`writing`), or it failed and the row is an orphan."""
        if writing and req_id in self.pending_pins.get(key, ()):
            return True
        return (req_id, key) in self.orphans

    def unpin_early(self, key: OffloadKey, req_id: str) -> None:
        """Release the pin `pinned_early` found (an orphan's row is released)."""
        row = self.orphans.pop((req_id, key), None)
        if row is not None:
            self.release([row])
            return
        pins = self.pending_pins[key]
        pins.remove(req_id)
        if not pins:
            del self.pending_pins[key]

    def write_failed(self, key: OffloadKey, row: int) -> None:
        """`key`'s write into `row` failed: each load that pinned it early holds the row,
        ``FAILED``, until it ends."""
        pins = self.pending_pins.pop(key, None)
        if pins:
            self.quarantined[row] += len(pins)
            self.orphans.update({(req_id, key): row for req_id in pins})
            if self.row_states is not None:
                self.row_states.settle(row, ok=False)

    def reset(self, keep_rows: Iterable[int]) -> None:
        """Every row is free but those in `keep_rows` (a hold each) and those quarantined
        already; early pins are void (as every transfer before a reset)."""
        self.quarantined.update(keep_rows)
        self.pending_pins.clear()
        orphans, self.orphans = list(self.orphans.values()), {}
        self.quarantined.subtract(orphans)
        self.quarantined = +self.quarantined  # (drops the rows no hold is left on)
        quarantined = self.quarantined
        # Lowest row first (`allocate` pops from the end).
        self._free = [row for row in reversed(range(self._used)) if row not in quarantined]
        if self.records is not None:
            self.records.retract_all()
        if self.row_states is not None:
            self.row_states.handle_store_failures(None)  # the stores they failed are forgotten too
            if orphans:
                self.row_states.mark([row for row in orphans if row not in quarantined], READY)
