"""`Refusals`: the CPU tier's reservations that found no row, counted by reason and traced.

Thread: the scheduler thread only (owned by `CPUOffloadingManager`).
"""

from __future__ import annotations

import logging

from tiering.stats import worth_logging

logger = logging.getLogger(__name__)

REFUSAL_REASONS = ("rows_in_flight", "larger_than_tier", "tenant_share")
"""Why a store or promotion found no row: every row it could free is held by a transfer in
flight (GPU stores and loads, promotions, cascades; the tier is too small for the load it
carries), the call alone needs more blocks than the tier has rows, or its tenant is beyond
its share and neither it nor a tenant over its share has an idle row (`tiering.cpu.tenants`)."""


class Refusals:
    """Per counter name (``stores_refused``, ``promotions_refused``), the refusals of a tier
    of `num_rows` rows by reason (`REFUSAL_REASONS`)."""

    def __init__(self, names: tuple[str, ...], num_rows: int):
        self.num_rows = num_rows
        self.counts = {name: dict.fromkeys(REFUSAL_REASONS, 0) for name in names}

    def refuse(self, name: str, blocks: int, shared: bool, rows_writing: int, rows_reading: int) -> None:
        """Count a refusal of a call of `blocks` blocks by its reason (`shared`: the rows are
        shared by tenants; `rows_writing`, `rows_reading`: rows held by transfers in flight
        now); log a trace of it (the 1st, 2nd, 4th, ... of each reason)."""
        if blocks > self.num_rows:
            reason = "larger_than_tier"
        elif shared and rows_writing + rows_reading < self.num_rows:
            reason = "tenant_share"
        else:
            reason = "rows_in_flight"
        count = self.counts[name][reason] = self.counts[name][reason] + 1
        if not worth_logging(count):
            return
        if reason == "tenant_share":
            logger.info(
                "CPU tier: %s (tenant_share, %d so far): a tenant beyond its share found no idle row of its own "
                "or of a tenant over its share (docs/sharing.md: tenants)",
                name.replace("_", " "),
                count,
            )
        else:
            logger.warning(
                "CPU tier: %s (%s, %d so far): %d blocks asked, %d rows of %d held by transfers in flight "
                "(%d being written, %d being read); a larger cpu_bytes_to_use avoids it "
                "(docs/vllm.md: sizing the CPU tier)",
                name.replace("_", " "),
                reason,
                count,
                blocks,
                rows_writing + rows_reading,
                self.num_rows,
                rows_writing,
                rows_reading,
            )
