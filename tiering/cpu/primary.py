"""`CPUPrimaryTierOffloadingManager`: the CPU tier as the primary tier of the engine, its rows
in a shared region, serving the secondary tiers' cascades and promotions beside the GPU.

Thread: the scheduler thread only; no method blocks, nothing is locked.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Container
from typing import Protocol

from tiering.contract.keys import OffloadKey, ReqContext
from tiering.contract.mediums import PrepareStoreOutput
from tiering.cpu.manager import CPUOffloadingManager
from tiering.cpu.readers import Reading, release_readers
from tiering.cpu.row_records import RowRecords, Sealer, Survival
from tiering.cpu.row_states import FAILED, PENDING, READY, RowStates
from tiering.cpu.tenants import TenantsConfig, TenantShares
from tiering.eviction.retention import RETENTION_MAX_FRACTION
from tiering.stats import TierStats

logger = logging.getLogger(__name__)

SEAL_ON_STOP_S = 30.0
"""How long a graceful stop of a crash-surviving CPU tier waits for its committed rows to be sealed."""


class KVRegion(Protocol):
    """What the primary tier needs of its memory (a `SharedOffloadRegion`, or a stand-in)."""

    def create_kv_memoryview(self) -> memoryview:
        """A 2-D memoryview of shape ``(num_blocks, row_bytes)``."""

    def cleanup(self) -> None:
        """Release the memory; called once, at shutdown."""


class CPUPrimaryTierOffloadingManager(CPUOffloadingManager):
    """The CPU manager as the primary tier of a `TieringOffloadingManager`.

    Its rows live in `mmap_region`; secondary tiers read and write them through
    `get_kv_memoryview()`. Besides the GPU's loads and stores, it serves the secondary tiers'
    two roles, counted apart from the GPU's: `prepare_read`/`complete_read` pin rows for a
    cascade (``blocks_read_by_tiers``), `prepare_write`/`complete_write` reserve rows for a
    promotion (``blocks_promoted``, ``promotions_refused`` by reason).
    """

    counter_names = (
        *CPUOffloadingManager.counter_names,
        "blocks_read_by_tiers",
        "blocks_promoted",
        "blocks_adopted",
        "blocks_sealed",
    )
    refusal_names = (*CPUOffloadingManager.refusal_names, "promotions_refused")

    def __init__(
        self,
        num_blocks: int,
        mmap_region: KVRegion,
        cache_policy: str = "lru",
        enable_events: bool = False,
        tenants: TenantsConfig | None = None,
        retention_max_fraction: float = RETENTION_MAX_FRACTION,
        survival: Survival | None = None,
    ):
        """
        Args:
            tenants: the tenants' shares of the rows (`tiering.cpu.tenants`), or None.
            retention_max_fraction: as `CPUOffloadingManager`.
            survival: with a region made to outlive its engine (`SharedOffloadRegion`'s
                ``keep``), how: the blocks its records hold are adopted now (`adopt`), and
                every write is recorded (`tiering.cpu.row_records`). None: nothing is.

        Raises:
            ValueError: as `CPUOffloadingManager`, or the region's view does not have
                `num_blocks` rows.
        """
        kv_view = mmap_region.create_kv_memoryview()
        if kv_view.ndim != 2 or kv_view.shape is None or kv_view.shape[0] != num_blocks:
            raise ValueError(f"region view has shape {kv_view.shape}; expected ({num_blocks}, row_bytes)")
        row_bytes = kv_view.nbytes // max(1, num_blocks)
        shares = (
            None
            if tenants is None
            else TenantShares(tenants, num_blocks, row_bytes, cache_policy, retention_max_fraction)
        )
        super().__init__(num_blocks, cache_policy, enable_events, shares, retention_max_fraction)
        self._region: KVRegion | None = mmap_region
        self._kv_view = kv_view
        create_row_states = getattr(mmap_region, "create_row_states", None)
        self.row_states = create_row_states() if create_row_states is not None else None
        self.survival = survival
        create_row_records = getattr(mmap_region, "create_row_records", None)
        self.records: RowRecords | None = create_row_records() if survival and create_row_records else None
        self._sealer: Sealer | None = None
        if self.records is not None:
            self._adopt(self.records)
            self._rows.records = self.records
            self._sealer = Sealer(self.records)

    def _adopt(self, records: RowRecords) -> None:
        """Take the blocks a dead engine committed into this region (none in a new one), ranked
        as its records list them, announced as stored (the events go out with the first
        step's, once the engine serves)."""
        found = records.adopt()
        if found.keys:
            blocks = self._rows.adopt(found.rows)
            self._resident.update(zip(found.keys, blocks, strict=True))
            self._order.insert_all(found.keys, blocks, self._order.tenant_of(ReqContext("")))
            self._counters["blocks_adopted"] += len(found.keys)
            self._emit(found.keys, removed=False)
        if found.keys or found.uncommitted or found.unsealed or found.corrupt:
            logger.info(
                "adopted %d blocks a dead engine left in the CPU tier; not adopted: %d uncommitted, "
                "%d committed but not sealed, %d that fail their checks",
                len(found.keys),
                found.uncommitted,
                found.unsealed,
                found.corrupt,
            )

    def drain_seals(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` seconds until every committed row is sealed (adoptable after
        a crash); whether it is (True where nothing is recorded). Any thread."""
        return self._sealer is None or self._sealer.drain(timeout_s)

    def follow_weights(self, weights: str | None) -> None:
        """A reset moved the engine to `weights` (`Survival.digest`): only an engine of those
        weights adopts the region from now on. Scheduler thread."""
        if self.records is not None and self.survival is not None:
            self.records.set_digest(self.survival.digest(weights))

    def prepare_read(self, keys: Collection[OffloadKey], req_context: ReqContext, readers: int = 1) -> Reading:
        """Pin rows for a cascade (one reader, released by one `complete_read` once every tier
        is done), as `prepare_load`; counted as read by `readers` tiers.

        Raises:
            KeyError: as `prepare_load`.
        """
        blocks = self._pin(keys, "prepare_read", "blocks_read_by_tiers", counted=readers)
        return Reading(keys, blocks)

    def complete_read(self, reading: Reading) -> None:
        """Release the rows `prepare_read` pinned (never after `reset_cache`: a reset voids
        them). Scheduler thread.

        Raises:
            KeyError: a row has no reader left (released twice); nothing is released.
        """
        self._rows_reading -= release_readers(reading.blocks, reading.keys, "complete_read")

    def prepare_write(
        self,
        keys: Collection[OffloadKey],
        req_context: ReqContext,
        protected: Container[OffloadKey] = (),
        settled_by_tier: bool = False,
    ) -> PrepareStoreOutput | None:
        """Reserve rows for a promotion: as `prepare_store`, a refusal counted apart; the
        blocks in `protected` (say, those the step's lookups found here) are not evicted for
        it. With `settled_by_tier` (the tier settles each row's `row_states` as it lands), the
        new rows are marked ``PENDING``, so that a load pinned early waits for them."""
        reserved = self._reserve(keys, req_context, "promotions_refused", protected)
        if settled_by_tier and reserved is not None and self.row_states is not None:
            self.row_states.mark(reserved.store_spec.block_ids, PENDING)
        return reserved

    def complete_write(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> list[OffloadKey]:
        """Finish a promotion: as `complete_store`, counted as promoted. Its rows' states
        end ``READY`` (a row a load pinned early and that failed: ``FAILED``, until freed)."""
        promoted = self._complete_writes(keys, success, "blocks_promoted")
        if promoted and self.row_states is not None:  # in case the tier did not settle them
            self.row_states.mark([self._resident[key].block_id for key in promoted], READY)
        return promoted

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> list[OffloadKey]:
        """As `CPUOffloadingManager.complete_store`; a row its worker marked ``FAILED`` (the
        GPU copy into it failed: `tiering.worker.cpu_gpu`) fails its key whatever `success`
        says."""
        if success and self.row_states is not None and keys and self.row_states.store_failures_pending():
            keys = self._without_failed_copies(keys, self.row_states)
        return super().complete_store(keys, req_context, success)

    def _without_failed_copies(self, keys: Collection[OffloadKey], row_states: RowStates) -> Collection[OffloadKey]:
        """`keys` less those whose row is ``FAILED``, whose writes are failed here."""
        resident = self._resident
        rows = {key: block.block_id for key in keys if (block := resident.get(key)) is not None and block.ref_cnt == -1}
        states = row_states.states
        failed = [key for key, row in rows.items() if states[row] == FAILED]
        if not failed:  # another store's rows failed: its completion is still to come, unless
            if not (states == FAILED).any():  # its caller failed it itself (rows freed since)
                row_states.handle_store_failures(None)
            return keys
        row_states.handle_store_failures(len(failed))
        logger.error("%d blocks stored from the GPU failed in the worker's copy: not kept", len(failed))
        self._complete_writes(failed, False, "blocks_stored")
        lost = set(failed)
        return [key for key in keys if key not in lost]

    def _complete_writes(self, keys: Collection[OffloadKey], success: bool, counter: str) -> list[OffloadKey]:
        done = super()._complete_writes(keys, success, counter)
        if done and self.records is not None:
            resident = self._resident
            self.records.commit(done, [resident[key].block_id for key in done])
        return done

    def get_stats(self) -> TierStats:
        """As `CPUOffloadingManager.get_stats`, plus the bytes of the GPU's stores and loads
        (``bytes_stored``, ``bytes_loaded``: blocks times the row's bytes)."""
        stats = super().get_stats()
        counters, row_bytes = stats["counters"], self._kv_view.nbytes // self.num_blocks
        counters["blocks_sealed"] = 0 if self._sealer is None else self._sealer.rows_sealed
        counters["bytes_stored"] = counters["blocks_stored"] * row_bytes
        counters["bytes_loaded"] = counters["blocks_loaded"] * row_bytes
        return stats

    def get_kv_memoryview(self) -> memoryview:
        """The primary rows, a 2-D memoryview of shape ``(num_blocks, row_bytes)``."""
        return self._kv_view

    def shutdown(self) -> None:
        """Release the region (once; later calls do nothing). A region kept on a graceful stop
        (`Survival.keep_on_stop`) is left with every committed row sealed (waiting up to
        `SEAL_ON_STOP_S` seconds); one not kept loses its kept name."""
        region, self._region = self._region, None
        if region is None:
            return
        if self._sealer is not None:
            if self.survival is not None and self.survival.keep_on_stop and not self.drain_seals(SEAL_ON_STOP_S):
                logger.warning(
                    "the CPU tier's rows were not all sealed in %.0f s: some will not be adopted", SEAL_ON_STOP_S
                )
            self._sealer.close()
            if self.records is not None:
                self.records.release()
            self.records = self._rows.records = None  # their arrays must not outlive the mapping
            if self.survival is not None and not self.survival.keep_on_stop:
                getattr(region, "drop_kept", lambda: None)()
        region.cleanup()
