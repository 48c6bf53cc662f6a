"""`CPUOffloadingManager`: the CPU tier's rows, ref counts, stores and loads (its primary-tier
form, which also serves the secondary tiers, is `tiering.cpu.primary`).

Thread: the scheduler thread only; no method blocks, nothing is locked.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Collection, Container, Iterable

from tiering.contract.keys import OffloadKey, ReqContext, RequestOffloadingContext
from tiering.contract.mediums import CPULoadStoreSpec, OffloadingEvent, PrepareStoreOutput
from tiering.contract.offloading import OffloadingManager
from tiering.cpu.request_access import RequestAccesses
from tiering.cpu.row_states import FAILED, READY, RowStates
from tiering.cpu.tenants import TenantShares
from tiering.eviction.policies import BlockStatus, CachePolicy, make_cache_policy
from tiering.eviction.retention import RETENTION_MAX_FRACTION, Either, Retention, hint_of
from tiering.stats import TierStats, lookup_counters, new_lookup_counts, worth_logging

logger = logging.getLogger(__name__)

REFUSAL_REASONS = ("rows_in_flight", "larger_than_tier", "tenant_share")
"""Why a store or promotion found no row: every row it could free is held by a transfer in
flight (GPU stores and loads, promotions, cascades; the tier is too small for the load it
carries), the call alone needs more blocks than the tier has rows, or its tenant is beyond
its share and neither it nor a tenant over its share has an idle row (`tiering.cpu.tenants`)."""


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
    row_states: RowStates | None = None  # the primary tier's, shared with the workers

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
        self._cache_policy = cache_policy
        self._policy = make_cache_policy(cache_policy, num_blocks)
        # The resident blocks by key, as the policy holds them: a plain dict, so that the
        # hot paths (several lookups per stored block) pay one C call, not a policy method.
        self._resident: dict[OffloadKey, BlockStatus] = {}
        self._free_block_ids: list[int] = []
        self._quarantined: Counter[int] = Counter()  # row -> holders: a late I/O may still use it
        self._num_ids_used = 0  # ids below this were handed out before
        self._events: list[OffloadingEvent] | None = [] if enable_events else None
        self._lookups = new_lookup_counts()
        self._counters: Counter[str] = Counter()
        self._refusals = {name: dict.fromkeys(REFUSAL_REASONS, 0) for name in self.refusal_names}
        self._rows_reading = 0  # rows with a reader (ref count > 0)
        self._rows_writing = 0  # rows with a write in flight (ref count -1)
        self._accesses = RequestAccesses()
        self.tenants = tenants
        max_retained = int(retention_max_fraction * num_blocks)
        self.retention = Retention(max_retained) if max_retained and tenants is None else None
        self._pending_pins: dict[OffloadKey, list[str]] = {}  # a write in flight -> requests pinning it
        self._orphans: dict[tuple[str, OffloadKey], int] = {}  # (request, key) -> row of a failed write it pins

    @property
    def num_free_blocks(self) -> int:
        """Rows that hold no block and are not quarantined."""
        return self.num_blocks - len(self._resident) - len(self._quarantined)

    @property
    def num_available_blocks(self) -> int:
        """Rows a reservation could take now: free rows and idle (evictable) ones, that is
        every row not held by a transfer in flight nor quarantined. Scheduler thread."""
        return self.num_blocks - self._rows_writing - self._rows_reading - len(self._quarantined)

    def coldest(self, n: int) -> list[OffloadKey]:
        """Up to `n` resident blocks in the order the policy would evict them, busy ones
        included. Scheduler thread."""
        return self._policy.coldest(n) if self.tenants is None else self.tenants.coldest(n)

    def ref_count(self, key: OffloadKey) -> int | None:
        """The ref count of `key`'s row, or None if the key is not resident."""
        block = self._resident.get(key)
        return None if block is None else block.ref_cnt

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
        spec = self._pin(keys, "prepare_load", "blocks_loaded", pending_ok=pending_ok, req_id=req_context.req_id)
        self._accesses.of(req_context.req_id).observe(keys, ready=keys)
        return spec

    def _pin(
        self,
        keys: Collection[OffloadKey],
        caller: str,
        counter: str,
        readers: int = 1,
        pending_ok: Container[OffloadKey] = (),
        req_id: str = "",
    ) -> CPULoadStoreSpec:
        blocks = self._blocks(keys, caller, min_ref_cnt=0, pending_ok=pending_ok)
        pending = [key for key, block in zip(keys, blocks, strict=True) if block.ref_cnt == -1] if pending_ok else ()
        for key in pending:  # a promotion's row, pinned before it lands
            self._pending_pins.setdefault(key, []).append(req_id)
        for block in blocks:
            if block.ref_cnt == 0:
                self._rows_reading += 1
            if block.ref_cnt >= 0:
                block.ref_cnt += readers
        self._counters[counter] += len(blocks) * readers
        return CPULoadStoreSpec([block.block_id for block in blocks])

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
        if self._pending_pins or self._orphans:
            early = [key for key in keys if self._pinned_early(key, req_context.req_id)]
            if early:
                pinned_early = set(early)
                keys = [key for key in keys if key not in pinned_early]
        blocks = self._blocks(keys, "complete_load", min_ref_cnt=1)
        for key in early:
            self._unpin_early(key, req_context.req_id)
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._rows_reading -= 1

    def _pinned_early(self, key: OffloadKey, req_id: str) -> bool:
        """Whether request `req_id` pinned `key` while its write was in flight, and has not
        released it: the write is still in flight, or it failed and the row is an orphan."""
        block = self._resident.get(key)
        if block is not None and block.ref_cnt == -1 and req_id in self._pending_pins.get(key, ()):
            return True
        return (req_id, key) in self._orphans

    def _unpin_early(self, key: OffloadKey, req_id: str) -> None:
        """Release the pin `_pinned_early` found."""
        row = self._orphans.pop((req_id, key), None)
        if row is not None:
            self.release_rows([row])
            return
        pins = self._pending_pins[key]
        pins.remove(req_id)
        if not pins:
            del self._pending_pins[key]

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
        policy, resident = self._policy_of(req_context), self._resident
        unique = dict.fromkeys(keys)
        keys_to_store = [key for key in unique if key not in resident]
        ready: list[OffloadKey] = []
        seen = keys_to_store  # the request's accesses: new or ready keys, in the order of `keys`
        if len(keys_to_store) < len(unique):
            seen = [key for key in unique if (block := resident.get(key)) is None or block.ref_cnt >= 0]
            ready = [key for key in seen if key in resident]
        access = self._accesses.of(req_context.req_id)
        if policy.learns_from_store_misses and keys_to_store:
            store_missed = access.store_missed
            first_misses = [key for key in keys_to_store if key not in store_missed]
            if first_misses:  # before `insert` takes them off ARC's ghost lists
                policy.on_store_miss(first_misses)
                store_missed.update(first_misses)
        access.observe(seen, ready)
        evicted: list[OffloadKey] = []
        shortfall = len(keys_to_store) - self.num_free_blocks
        tenants = self.tenants
        tenant = tenants.tenant_of(req_context) if tenants is not None else ""
        if shortfall > 0:
            kept = Either(unique, protected) if protected else unique
            if tenants is None:
                victims = self._evict(policy, shortfall, kept)
            else:
                victims = tenants.evict(shortfall, kept, tenant, len(keys_to_store))
            if victims is None:
                self._refuse(refused_counter, len(unique), tenants is not None)
                return None
            for key, block in victims:
                del resident[key]
                self._free_block_ids.append(block.block_id)
                evicted.append(key)
            if self.retention is not None and self.retention.active:
                self.retention.forget(evicted)
            self._counters["evictions"] += len(victims)
            self._emit(evicted, removed=True)
        block_ids = [self._allocate_block_id() for _ in keys_to_store]
        self._rows_writing += len(block_ids)
        for key, block_id in zip(keys_to_store, block_ids, strict=True):
            block = resident[key] = BlockStatus(block_id)
            if tenants is None:
                policy.insert(key, block)
            else:
                tenants.insert(key, block, tenant)
        access.inserted.update(keys_to_store)
        return PrepareStoreOutput(keys_to_store, CPULoadStoreSpec(block_ids), evicted)

    def _refuse(self, refused_counter: str, blocks: int, shared: bool = False) -> None:
        """Count a refusal of a call of `blocks` blocks by its reason (`shared`: the rows are
        shared by tenants); log a trace of it."""
        if blocks > self.num_blocks:
            reason = "larger_than_tier"
        elif shared and self._rows_writing + self._rows_reading < self.num_blocks:
            reason = "tenant_share"
        else:
            reason = "rows_in_flight"
        count = self._refusals[refused_counter][reason] = self._refusals[refused_counter][reason] + 1
        if reason == "tenant_share" and worth_logging(count):
            logger.info(
                "CPU tier: %s (tenant_share, %d so far): a tenant beyond its share found no idle row of its own "
                "or of a tenant over its share (README: tenants)",
                refused_counter.replace("_", " "),
                count,
            )
        elif worth_logging(count):
            logger.warning(
                "CPU tier: %s (%s, %d so far): %d blocks asked, %d rows of %d held by transfers in flight "
                "(%d being written, %d being read); a larger cpu_bytes_to_use avoids it (README: sizing the CPU tier)",
                refused_counter.replace("_", " "),
                reason,
                count,
                blocks,
                self._rows_writing + self._rows_reading,
                self.num_blocks,
                self._rows_writing,
                self._rows_reading,
            )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> list[OffloadKey]:
        """Finish the in-flight writes of `keys`; other keys are ignored.

        On success each row becomes idle (its rank is the one `prepare_store` gave it, so
        the order of `keys` does not matter); on failure it is freed.

        A row its worker marked ``FAILED`` (the GPU copy into it failed: `tiering.worker.cpu_gpu`)
        fails its key whatever `success` says.

        Returns:
            The keys that became loadable by this call (empty on failure).
        """
        if success and self.row_states is not None and keys and self.row_states.store_failures_pending():
            keys = self._without_failed_copies(keys)
        stored = self._complete_writes(keys, success, "blocks_stored")
        if self.tenants is not None and stored:
            self.tenants.count(self.tenants.tenant_of(req_context), "blocks_stored", len(stored))
        return stored

    def _without_failed_copies(self, keys: Collection[OffloadKey]) -> Collection[OffloadKey]:
        """`keys` less those whose row is ``FAILED``, whose writes are failed here."""
        assert self.row_states is not None
        resident = self._resident
        rows = {key: block.block_id for key in keys if (block := resident.get(key)) is not None and block.ref_cnt == -1}
        states = self.row_states.states
        failed = [key for key, row in rows.items() if states[row] == FAILED]
        if not failed:  # another store's rows failed: its completion is still to come, unless
            if not (states == FAILED).any():  # its caller failed it itself (rows freed since)
                self.row_states.handle_store_failures(None)
            return keys
        self.row_states.handle_store_failures(len(failed))
        logger.error("%d blocks stored from the GPU failed in the worker's copy: not kept", len(failed))
        self._complete_writes(failed, False, "blocks_stored")
        lost = set(failed)
        return [key for key in keys if key not in lost]

    def _evict(
        self, policy: CachePolicy, n: int, kept: Container[OffloadKey]
    ) -> list[tuple[OffloadKey, BlockStatus]] | None:
        """`n` victims of `policy` not in `kept`: blocks without a retention deadline first;
        if those are too few, the retained ones with the earliest deadlines lose theirs
        (`tiering.eviction.retention`). None if even that leaves too few."""
        retention = self.retention
        if retention is None or not retention.active:
            return policy.evict(n, protected=kept)
        released: list[tuple[OffloadKey, BlockStatus]] = []
        if retention.has_released:
            resident = self._resident

            def evictable(key: OffloadKey) -> bool:
                block = resident.get(key)
                return block is not None and block.ref_cnt == 0 and key not in kept

            for key in retention.released(n, evictable):
                block = policy.remove(key)
                if block is not None:
                    released.append((key, block))
            if len(released) == n:
                return released
        rest = self._evict_unreleased(policy, n - len(released), kept)
        if rest is None:  # refused after all: the released blocks stay (still released)
            for key, block in released:
                policy.insert(key, block)
            return None
        return released + rest

    def _evict_unreleased(
        self, policy: CachePolicy, n: int, kept: Container[OffloadKey]
    ) -> list[tuple[OffloadKey, BlockStatus]] | None:
        """`_evict`'s blocks without a deadline first, then those with the earliest."""
        assert self.retention is not None
        retained = self.retention.live()
        if retained is None:
            return policy.evict(n, protected=kept)
        victims = policy.evict(n, protected=Either(kept, retained))
        if victims is not None:
            return victims
        try:
            short = n - len(policy.candidates(n, Either(kept, retained)))
        except NotImplementedError:
            short = n
        self.retention.give_up(short, kept)
        return policy.evict(n, protected=Either(kept, self.retention.live() or ()))

    def _complete_writes(self, keys: Collection[OffloadKey], success: bool, counter: str) -> list[OffloadKey]:
        if not success:
            rows = self._drop_writes(keys)
            if self._quarantined:  # rows a load pinned early stay out of use until it ends
                rows = [row for row in rows if row not in self._quarantined]
            self._free_rows(rows)
            return []
        resident, pending_pins = self._resident, self._pending_pins
        stored: list[OffloadKey] = []
        for key in keys:
            block = resident.get(key)
            if block is None or block.ref_cnt != -1:
                continue
            block.ref_cnt = 0
            if pending_pins and (pins := pending_pins.pop(key, None)):
                block.ref_cnt = len(pins)
                self._rows_reading += 1
            stored.append(key)
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
        self._quarantined.update(rows)
        return rows

    def release_rows(self, block_ids: Iterable[int]) -> None:
        """Release one hold on each row quarantined by `quarantine_writes` or kept by
        `reset_cache`; a row with no hold left is free again. Scheduler thread.

        Raises:
            KeyError: a row has no hold (released twice, say).
        """
        quarantined = self._quarantined
        for block_id in block_ids:
            if quarantined[block_id] < 1:  # (a Counter: reading a missing row adds nothing)
                raise KeyError(f"release_rows: row {block_id} is not quarantined")
            quarantined[block_id] -= 1
            if not quarantined[block_id]:
                del quarantined[block_id]
                self._free_rows([block_id])

    def _free_rows(self, rows: list[int]) -> None:
        """Make `rows` free; a row a failed promotion left ``FAILED`` is ``READY`` again."""
        if rows and self.row_states is not None:
            self.row_states.mark(rows, READY)
        self._free_block_ids.extend(rows)

    def _drop_writes(self, keys: Collection[OffloadKey]) -> list[int]:
        """Forget the keys whose write is in flight; returns their rows (not freed). A row
        that loads pinned early is quarantined, a hold per load, each released by that
        load's `complete_load`; it is ``FAILED`` meanwhile, so the loads copy nothing."""
        rows = []
        for key in keys:
            block = self._resident.get(key)
            if block is not None and block.ref_cnt == -1:
                if self.tenants is None:
                    self._policy.remove(key)
                    if self.retention is not None:
                        self.retention.forget((key,))
                else:
                    self.tenants.remove(key)
                del self._resident[key]
                rows.append(block.block_id)
                if self._pending_pins and (pins := self._pending_pins.pop(key, None)):
                    self._quarantined[block.block_id] += len(pins)
                    self._orphans.update({(req_id, key): block.block_id for req_id in pins})
                    if self.row_states is not None:
                        self.row_states.settle(block.block_id, ok=False)
        self._counters["blocks_store_failed"] += len(rows)
        self._rows_writing -= len(rows)
        return rows

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        """Apply the request's accesses to the eviction order, once: its blocks in prefix
        order, the head most recent (see `tiering.cpu.request_access`). A request with no
        recorded access, or finished twice, changes nothing."""
        access = self._accesses.finished(req_context.req_id)
        if access is not None and access.keys:
            policy = self._policy_of(req_context)
            policy.on_request_finished(access.prefix_order(req_context), access.inserted, access.reused)
            retention = (
                self.retention if self.tenants is None else self.tenants.retention(self.tenants.tenant_of(req_context))
            )
            if retention is not None:
                hint = hint_of(req_context)
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
        a dict of counts by reason, `REFUSAL_REASONS`) and gauges (blocks held, capacity in
        blocks, rows pinned by readers and by writes in flight, rows quarantined). Cheap;
        scheduler thread."""
        counters = {
            **lookup_counters(self._lookups),
            **{name: self._counters[name] for name in self.counter_names},
            **{name: dict(reasons) for name, reasons in self._refusals.items()},
            **(self.retention.counters if self.retention is not None else {}),
            **(self.tenants.retention_counters if self.tenants is not None else {}),
        }
        gauges = {
            "blocks": len(self._resident),
            "retained_blocks": self.tenants.retained_blocks if self.tenants is not None else len(self.retention or ()),
            "capacity_blocks": self.num_blocks,
            "rows_reading": self._rows_reading,
            "rows_writing": self._rows_writing,
            "rows_quarantined": len(self._quarantined),
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
        self._quarantined.update(keep_rows)
        self._policy = make_cache_policy(self._cache_policy, self.num_blocks)
        if self.retention is not None:
            self.retention.clear()
        if self.tenants is not None:
            self.tenants.reset()
        self._resident.clear()
        self._accesses.clear()
        self._pending_pins.clear()  # the loads that pinned early are void, as every transfer before a reset
        orphans, self._orphans = list(self._orphans.values()), {}
        self._quarantined.subtract(orphans)
        self._quarantined = +self._quarantined  # (drops the rows no hold is left on)
        self._rows_reading = self._rows_writing = 0
        quarantined = self._quarantined
        # Lowest row first (`_allocate_block_id` pops from the end).
        self._free_block_ids = [row for row in reversed(range(self._num_ids_used)) if row not in quarantined]
        if self.row_states is not None:
            self.row_states.handle_store_failures(None)  # the stores they failed are forgotten too
            if orphans:
                self.row_states.mark([row for row in orphans if row not in quarantined], READY)

    def _retention_of(self, req_context: ReqContext) -> Retention | None:
        """The deadlines of `req_context`'s request's blocks (its tenant's), or None: hints
        are ignored."""
        tenants = self.tenants
        return self.retention if tenants is None else tenants.retention(tenants.tenant_of(req_context))

    def _policy_of(self, req_context: ReqContext) -> CachePolicy:
        """The policy that ranks the blocks of `req_context`'s request (its tenant's)."""
        return self._policy if self.tenants is None else self.tenants.policy(self.tenants.tenant_of(req_context))

    def _blocks(
        self, keys: Collection[OffloadKey], caller: str, min_ref_cnt: int, pending_ok: Container[OffloadKey] = ()
    ) -> list[BlockStatus]:
        """The resident blocks of `keys`, each with a ref count of at least `min_ref_cnt`, or
        of -1 (a write in flight) for the keys in `pending_ok`.

        Raises:
            KeyError: a key is not resident, or its ref count is lower.
        """
        get, blocks = self._resident.get, []
        for key in keys:
            block = get(key)
            if block is None or (block.ref_cnt < min_ref_cnt and not (block.ref_cnt == -1 and key in pending_ok)):
                state = "not resident" if block is None else f"ref count {block.ref_cnt}"
                raise KeyError(f"{caller}: key {key.hex()} is {state}")
            blocks.append(block)
        return blocks

    def _allocate_block_id(self) -> int:
        """A free row: the most recently freed one first, then rows never used. (vLLM hands
        out never-used rows first. Reusing a row that was just written keeps the tier's
        touched memory, its page faults and its resident set as small as the working set
        allows, and no row is better than another for what it holds.)"""
        if self._free_block_ids:
            return self._free_block_ids.pop()
        self._num_ids_used += 1
        return self._num_ids_used - 1

    def _emit(self, keys: list[OffloadKey], removed: bool) -> None:
        if keys and self._events is not None:
            self._events.append(OffloadingEvent(keys=keys, medium=self.medium, removed=removed))
