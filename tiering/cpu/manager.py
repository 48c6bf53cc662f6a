"""`CPUOffloadingManager`: the CPU tier's rows, ref counts, stores and loads (its primary-tier
form, which also serves the secondary tiers, is `tiering.cpu.primary`).

Thread: the scheduler thread only; no method blocks, nothing is locked.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Container, Iterable
from operator import itemgetter

from tiering.contract.keys import OffloadKey, ReqContext, RequestOffloadingContext
from tiering.contract.mediums import LOCAL, CPULoadStoreSpec, OffloadingEvent, PrepareStoreOutput
from tiering.contract.offloading import OffloadingManager
from tiering.cpu.order import EvictionOrder
from tiering.cpu.readers import BLOCK_ID, add_readers, release_readers, undo_readers
from tiering.cpu.refusals import Refusals
from tiering.cpu.request_access import RequestAccesses
from tiering.cpu.row_states import RowStates
from tiering.cpu.rows import Rows
from tiering.cpu.tenants import TenantShares
from tiering.eviction.policies import BlockStatus, CachePolicy
from tiering.eviction.retention import RETENTION_MAX_FRACTION, Either, hint_of
from tiering.stats import RareLog, TierStats, lookup_counters, new_lookup_counts

_KEY, _BLOCK = itemgetter(0), itemgetter(1)  # (mapped in C, on hot paths)


class CPUOffloadingManager(OffloadingManager):
    """Bookkeeping of `num_blocks` CPU rows: which key is in which row, ref counts, eviction.

    Ref counts: a row is -1 from `prepare_store` to `complete_store` (write in flight), then
    0 (idle, evictable); `prepare_load` adds one reader and `complete_load` removes it. Only
    idle rows are evicted. A load may pin a row whose promotion is still being written
    (`prepare_load`'s ``pending_ok``): its reader counts from the write's end, and if the
    write fails the row stays out of use until that load's `complete_load`.

    Eviction order is that of vLLM's own CPU manager: a block is ranked when its row is
    reserved, and a finished request re-ranks the blocks it loaded or offered (its head
    ends most recent; see `tiering.cpu.request_access`), so the order never depends on the
    order or container of `complete_store`'s keys. Call every method from the scheduler
    thread.
    """

    medium = CPULoadStoreSpec.medium()
    counter_names: tuple[str, ...] = (
        "blocks_stored",
        "blocks_store_failed",
        "blocks_loaded",
        "evictions",
    )
    refusal_names: tuple[str, ...] = ("stores_refused",)

    def __init__(
        self,
        num_blocks: int,
        cache_policy: str = "lru",
        enable_events: bool = False,
        tenants: TenantShares | None = None,
        retention_max_fraction: float = RETENTION_MAX_FRACTION,
    ):
        """
        Args:
            num_blocks: rows of the CPU buffer (> 0).
            cache_policy: eviction policy name, ``"lru"`` or ``"arc"``.
            enable_events: collect `OffloadingEvent`s for `take_events`.
            tenants: the tenants' shares of the rows, or None: every request alike.
            retention_max_fraction: the share of the rows that requests' retention hints
                may hold at once (`tiering.eviction.retention`; with `tenants`, of each tenant's
                share, as `tenants` was built); 0: hints are ignored.

        Raises:
            ValueError: `num_blocks` < 1, or `cache_policy` is unknown.
        """
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        # The resident blocks by key, as the policy holds them: a plain dict, so that the
        # hot paths (several lookups per stored block) pay one C call, not a policy method.
        self._resident: dict[OffloadKey, BlockStatus] = {}
        self._rows = Rows(num_blocks)
        self._events: list[OffloadingEvent] | None = [] if enable_events else None
        self._lookups = new_lookup_counts()
        self._hint_warnings = RareLog()  # clients' hints that do not parse: logged rarely
        self._counters: Counter[str] = Counter()
        self._refusals = Refusals(self.refusal_names, num_blocks)
        self._rows_reading = 0  # rows with a reader (ref count > 0)
        self._rows_writing = 0  # rows with a write in flight (ref count -1)
        self._accesses = RequestAccesses()
        self.tenants = tenants
        self._order: EvictionOrder | TenantShares = (
            tenants
            if tenants is not None
            else EvictionOrder(cache_policy, num_blocks, int(retention_max_fraction * num_blocks))
        )
        self.retention = self._order.retention("") if tenants is None else None

    @property
    def row_states(self) -> RowStates | None:
        """The rows' states shared with the workers (the primary tier's), or None."""
        return self._rows.row_states

    @row_states.setter
    def row_states(self, states: RowStates | None) -> None:
        self._rows.row_states = states

    @property
    def num_free_blocks(self) -> int:
        """Rows that hold no block and are not quarantined."""
        return self.num_blocks - len(self._resident) - len(self._rows.quarantined)

    @property
    def num_available_blocks(self) -> int:
        """Rows a reservation could take now: free rows and idle (evictable) ones, that is
        every row not held by a transfer in flight nor quarantined. Scheduler thread."""
        return self.num_blocks - self._rows_writing - self._rows_reading - len(self._rows.quarantined)

    def coldest(self, n: int) -> list[OffloadKey]:
        """Up to `n` resident blocks, busy ones too, as the policy would evict them (oldest first)."""
        return self._order.coldest(n)

    def ref_count(self, key: OffloadKey) -> int | None:
        """The ref count of `key`'s row, or None if the key is not resident."""
        block = self._resident.get(key)
        return None if block is None else block.ref_cnt

    def write_in_flight(self, key: OffloadKey) -> bool:
        """Whether a write into `key`'s row (a GPU store or a promotion) is in flight. Scheduler thread."""
        return (block := self._resident.get(key)) is not None and block.ref_cnt < 0

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        """True if `key` is stored, None while its write is in flight, False otherwise."""
        block = self._resident.get(key)
        answer = False if block is None else (True if block.ref_cnt >= 0 else None)
        self._lookups[answer] += 1
        if self.tenants is not None and answer is not None:
            self.tenants.count(self.tenants.tenant_of(req_context), "hits" if answer else "misses")
        return answer

    def prepare_load(
        self, keys: Collection[OffloadKey], req_context: ReqContext, pending_ok: Container[OffloadKey] = ()
    ) -> CPULoadStoreSpec:
        """Pin the rows of `keys` (one reader each) and return them in the order of `keys`.

        Args:
            pending_ok: keys whose write in flight (a promotion the worker's load waits for,
                `tiering.cpu.row_states`) may be pinned too; their reader counts once the write
                completes, and a failed write keeps the row until this request's
                `complete_load`.

        Raises:
            KeyError: a key is not resident, or its write is in flight and it is not in
                `pending_ok`; nothing is pinned.
        """
        blocks = self._pin(keys, "prepare_load", "blocks_loaded", pending_ok=pending_ok, req_id=req_context.req_id)
        self._accesses.of(req_context.req_id).observe(keys, ready=keys)
        return CPULoadStoreSpec(list(map(BLOCK_ID, blocks)))

    def _pin(
        self,
        keys: Collection[OffloadKey],
        caller: str,
        counter: str,
        counted: int = 1,
        pending_ok: Container[OffloadKey] = (),
        req_id: str = "",
    ) -> list[BlockStatus]:
        """Add a reader to each row of `keys` (see `prepare_load`); returns their statuses."""
        blocks = self._blocks(keys, caller)
        first, writing = add_readers(blocks)
        if writing:  # a write in flight: each must be in `pending_ok`, else nothing is pinned
            pending = [key for key, block in zip(keys, blocks, strict=True) if block.ref_cnt == -1]
            refused = [key for key in pending if key not in pending_ok]
            if refused:
                undo_readers(blocks)
                raise KeyError(f"{caller}: key {refused[0].hex()} is ref count -1")
            for key in pending:  # a promotion's row, pinned before it lands
                self._rows.pin_early(key, req_id)
        self._rows_reading += first
        self._counters[counter] += len(blocks) * counted
        return blocks

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Record a use of the resident `keys` now; the first one ends up the most recent.
        (vLLM's scheduler does not call it: its requests' uses are applied when they finish.)"""
        self._policy_of(req_context).touch(keys)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Release one reader of each key's row.

        Raises:
            KeyError: a key is not resident or has no reader; nothing is released.
        """
        early: list[OffloadKey] = []
        rows = self._rows
        if rows.pending_pins or rows.orphans:
            resident, req_id = self._resident, req_context.req_id
            early = [
                key
                for key in keys
                if rows.pinned_early(key, req_id, (block := resident.get(key)) is not None and block.ref_cnt == -1)
            ]
            if early:
                pinned_early = set(early)
                keys = [key for key in keys if key not in pinned_early]
        self._rows_reading -= release_readers(self._blocks(keys, "complete_load"), keys, "complete_load")
        for key in early:
            rows.unpin_early(key, req_context.req_id)

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        """Reserve rows for the keys not yet resident, evicting idle blocks if needed.

        Keys of this call are never evicted by it. The reserved rows are in flight (ref
        count -1) until `complete_store`, and ranked most recent now, in the order of
        `keys`. The request's new and ready keys count as its accesses (see the class).

        Returns:
            The keys to copy with their rows and the evicted keys, or None (changing
            nothing) if fewer rows than needed can be freed.
        """
        return self._reserve(keys, req_context, "stores_refused")

    def _reserve(
        self,
        keys: Collection[OffloadKey],
        req_context: ReqContext,
        refused_counter: str,
        protected: Container[OffloadKey] = (),
    ) -> PrepareStoreOutput | None:
        order, resident = self._order, self._resident
        tenant = order.tenant_of(req_context)
        policy = order.policy(tenant)
        unique = dict.fromkeys(keys)
        # (set operations run in C: a store of new blocks, the common case, needs no loop)
        keys_to_store = list(unique) if resident.keys().isdisjoint(unique) else [k for k in unique if k not in resident]
        ready: list[OffloadKey] = []
        seen = keys_to_store  # the request's accesses: new or ready keys, in the order of `keys`
        if len(keys_to_store) < len(unique):
            seen = [key for key in unique if (block := resident.get(key)) is None or block.ref_cnt >= 0]
            ready = [key for key in seen if key in resident]
        access = self._accesses.of(req_context.req_id)
        if policy.learns_from_store_misses and keys_to_store:
            store_missed = access.store_missed
            first_misses = [key for key in keys_to_store if key not in store_missed] if store_missed else keys_to_store
            if first_misses:  # before `insert` takes them off ARC's ghost lists
                policy.on_store_miss(first_misses)
                store_missed.update(first_misses)
        access.observe(seen, ready)
        evicted: list[OffloadKey] = []
        shortfall = len(keys_to_store) - self.num_free_blocks
        if shortfall > 0:
            kept = Either(unique, protected) if protected else unique
            victims = order.evict(shortfall, kept, tenant, len(keys_to_store))
            if victims is None:
                shared = self.tenants is not None
                self._refusals.refuse(refused_counter, len(unique), shared, self._rows_writing, self._rows_reading)
                return None
            evicted = list(map(_KEY, victims))
            for key in evicted:
                del resident[key]
            self._rows.free(list(map(BLOCK_ID, map(_BLOCK, victims))), evicted=True)
            self._counters["evictions"] += len(victims)
            self._emit(evicted, removed=True)
        block_ids, blocks = self._rows.allocate(len(keys_to_store))
        self._rows_writing += len(block_ids)
        resident.update(zip(keys_to_store, blocks, strict=False))
        order.insert_all(keys_to_store, blocks, tenant)
        access.inserted.update(keys_to_store)
        return PrepareStoreOutput(keys_to_store, CPULoadStoreSpec(block_ids), evicted)

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> list[OffloadKey]:
        """Finish the in-flight writes of `keys`; other keys are ignored.

        On success each row becomes idle (its rank is the one `prepare_store` gave it, so
        the order of `keys` does not matter); on failure it is freed.

        Returns:
            The keys that became loadable by this call (empty on failure).
        """
        stored = self._complete_writes(keys, success, "blocks_stored")
        if self.tenants is not None and stored:
            self.tenants.count(self.tenants.tenant_of(req_context), "blocks_stored", len(stored))
        return stored

    def _complete_writes(self, keys: Collection[OffloadKey], success: bool, counter: str) -> list[OffloadKey]:
        if not success:
            rows = self._drop_writes(keys)
            if quarantined := self._rows.quarantined:  # rows a load pinned early stay out of use until it ends
                rows = [row for row in rows if row not in quarantined]
            self._rows.free(rows)
            return []
        resident, pending_pins = self._resident, self._rows.pending_pins
        stored: list[OffloadKey] = []
        for key in keys:
            block = resident.get(key)
            if block is not None and block.ref_cnt == -1:
                block.ref_cnt = 0
                stored.append(key)
        for key in stored if pending_pins else ():  # loads pinned them early: their readers count now
            if pins := pending_pins.pop(key, None):
                resident[key].ref_cnt = len(pins)
                self._rows_reading += 1
        self._counters[counter] += len(stored)
        self._rows_writing -= len(stored)
        self._emit(stored, removed=False)
        return stored

    def quarantine_writes(self, keys: Collection[OffloadKey], req_context: ReqContext) -> list[int]:
        """Fail the in-flight writes of `keys` as ``complete_store(success=False)`` does, but
        keep their rows out of use: an I/O that timed out may still write into them. Other
        keys are ignored.

        Scheduler thread.

        Returns:
            The quarantined row ids, to hand to `release_rows` once that I/O has returned.
        """
        rows = self._drop_writes(keys)
        self._rows.quarantine(rows)
        return rows

    def release_rows(self, block_ids: Iterable[int]) -> None:
        """Release one hold on each row quarantined by `quarantine_writes` or kept by
        `reset_cache`; a row with no hold left is free again. Scheduler thread.

        Raises:
            KeyError: a row has no hold (released twice, say).
        """
        self._rows.release(block_ids)

    def _drop_writes(self, keys: Collection[OffloadKey]) -> list[int]:
        """Forget the keys whose write is in flight; returns their rows (not freed). A row
        that loads pinned early is quarantined, a hold per load, each released by that
        load's `complete_load`; it is ``FAILED`` meanwhile, so the loads copy nothing. The
        keys are announced removed, though never stored: vLLM's event tracker, which
        recorded their tokens when the store or the lookup of the promotion began, forgets
        them then (a router drops a removal of a block it never saw)."""
        rows, dropped = [], []
        for key in keys:
            block = self._resident.get(key)
            if block is not None and block.ref_cnt == -1:
                self._order.remove(key)
                del self._resident[key]
                rows.append(block.block_id)
                dropped.append(key)
                if self._rows.pending_pins:
                    self._rows.write_failed(key, block.block_id)
        self._counters["blocks_store_failed"] += len(rows)
        self._rows_writing -= len(rows)
        self._emit(dropped, removed=True)
        return rows

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        """Apply the request's accesses to the eviction order, once: its blocks in prefix
        order, the head most recent (see `tiering.cpu.request_access`). A request with no
        recorded access, or finished twice, changes nothing."""
        access = self._accesses.finished(req_context.req_id)
        if access is not None and access.keys:
            tenant = self._order.tenant_of(req_context)
            policy = self._order.policy(tenant)
            policy.on_request_finished(access.prefix_order(req_context), access.inserted, access.reused)
            retention = self._order.retention(tenant)
            if retention is not None:
                if access.reused:  # before any release: another request's are not its to release
                    retention.shared(access.reused)
                hint = hint_of(req_context, self._hint_warnings)
                if hint is None:
                    retention.used(access.keys)
                else:
                    used = [key for key in access.keys if key in self._resident]  # stored or loaded
                    if hint.release:  # its own blocks: those it found already there others use too
                        retention.release(key for key in used if key not in access.reused)
                    if hint.retain_s is not None:
                        retention.retain(used, hint.retain_s)

    def get_stats(self) -> TierStats:
        """Counters (lookups by answer, blocks stored and loaded, evictions, refused stores as
        a dict of counts by reason, `tiering.cpu.refusals.REFUSAL_REASONS`) and gauges (blocks held, capacity in
        blocks, rows pinned by readers and by writes in flight, rows quarantined). Cheap;
        scheduler thread."""
        counters = {
            **lookup_counters(self._lookups),
            **{name: self._counters[name] for name in self.counter_names},
            **{name: dict(reasons) for name, reasons in self._refusals.counts.items()},
            **self._order.retention_counters,
        }
        gauges = {
            "blocks": len(self._resident),
            "retained_blocks": self._order.retained_blocks,
            "capacity_blocks": self.num_blocks,
            "rows_reading": self._rows_reading,
            "rows_writing": self._rows_writing,
            "rows_quarantined": len(self._rows.quarantined),
            "healthy": True,
        }
        return {"counters": counters, "gauges": gauges, "histograms": {}}

    def take_events(self) -> list[OffloadingEvent]:
        """Events since the last call, oldest first; always empty if events are disabled."""
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

    def reset_cache(self, keep_rows: Iterable[int] = ()) -> None:
        """Forget every block, whatever its ref count, as vLLM's own manager does: no
        event is emitted, the policy and the request accesses start afresh, every row is
        free except those in `keep_rows` and those already quarantined.

        Transfers started before the reset are void: their ``complete_store`` /
        ``complete_load`` must not be called (vLLM's connector drops their completions),
        and the caller must let them finish before a new transfer touches their rows
        (vLLM's connector flushes them to the workers before the next step's transfers).

        Args:
            keep_rows: rows some I/O outside the caller's control may still use (a
                secondary tier's job in flight); each listing is one hold, released by
                `release_rows`.
        """
        self._rows.reset(keep_rows)
        self._order.reset()
        self._resident.clear()
        self._accesses.clear()
        self._rows_reading = self._rows_writing = 0

    def _policy_of(self, req_context: ReqContext) -> CachePolicy:
        """The policy that ranks the blocks of `req_context`'s request (its tenant's)."""
        return self._order.policy(self._order.tenant_of(req_context))

    def _blocks(self, keys: Collection[OffloadKey], caller: str) -> list[BlockStatus]:
        """The resident blocks of `keys`, in order, whatever their ref counts.

        Raises:
            KeyError: a key is not resident.
        """
        resident = self._resident
        try:
            return [resident[key] for key in keys]
        except KeyError as missing:
            raise KeyError(f"{caller}: key {missing.args[0].hex()} is not resident") from None

    def _emit(self, keys: list[OffloadKey], removed: bool) -> None:
        if keys and self._events is not None:
            self._events.append(OffloadingEvent(keys=keys, medium=self.medium, removed=removed, locality=LOCAL))
