"""`BlockStoreSettings`: the config keys every block-store tier takes, whatever its store.

Read on the thread that builds the engine; immutable after.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tiering.eviction.retention import RETENTION_MAX_FRACTION
from tiering.options import STRICT, Count, Delay, Seconds, Size
from tiering.tiers.seal import Integrity


class BlockStoreSettings(BaseModel):
    """How the adapter runs a store. A store changes the defaults with its `tier_defaults`.

    Attributes:
        capacity_bytes: object bytes held at most (headers included), or None for no limit.
        max_concurrency: store calls (a block, or a batch) in flight at once.
        op_timeout_s: seconds one store call may take before its blocks fail.
        open_timeout_s: seconds opening the store and recovering its index may take.
        shutdown_timeout_s: seconds `shutdown` waits for calls in flight.
        batch_bytes: a job's blocks reach the store (`put_many`/`get_many`) in batches of
            about this many bytes, amortising the per-call cost of small blocks; 1 sends
            one block per call.
        probe_misses: a lookup of a key not in the index asks the store whether it exists
            (None until the answer), for stores other engines write to (a shared directory
            or bucket).
        negative_ttl_s: how long a probe's "absent" is believed, seconds.
        index_max_blocks: keys the tier's index remembers at most, or None for no limit;
            beyond it the least recent are forgotten, not deleted (for a store that evicts by
            itself, whose index would otherwise keep every key it ever stored; a forgotten
            block that is still there is found again by a probe).
        failure_threshold: consecutive failed calls that turn the tier unhealthy.
        backoff_s: first wait, seconds, before an unhealthy tier is probed; it doubles
            after each failed probe up to `max_backoff_s`.
        max_backoff_s: the longest such wait, seconds.
        integrity: where the tier's secret keys come from (``{keys_env: NAME}`` or
            ``{keys_file: PATH}``), or None: with keys, every object is sealed and only
            objects sealed by one of them load (see `tiering.tiers.seal`).
        encryption: ``aes-256-gcm`` to encrypt payloads with those keys, or None to sign
            them only.
        retention_max_fraction: the share of `capacity_bytes` that requests' retention hints
            may hold at once (`tiering.eviction.retention`); 0: hints are ignored here. Without a
            capacity the tier evicts nothing, and keeps no deadlines.
    """

    model_config = ConfigDict(**STRICT, frozen=True)

    capacity_bytes: Size | None = None
    max_concurrency: Count = 64
    op_timeout_s: Seconds = 30.0
    open_timeout_s: Seconds = 120.0
    shutdown_timeout_s: Seconds = 30.0
    batch_bytes: Size = 4 << 20
    probe_misses: bool = False
    negative_ttl_s: Delay = 5.0
    index_max_blocks: Count | None = None
    failure_threshold: Count = 5
    backoff_s: Seconds = 1.0
    max_backoff_s: Seconds = 5.0
    integrity: Integrity | None = None
    encryption: Literal["aes-256-gcm"] | None = None
    retention_max_fraction: float = Field(default=RETENTION_MAX_FRACTION, ge=0, le=1)

    def check_client_timeouts(self, **timeouts: float) -> None:
        """A store's client timeouts (seconds, by option name) must be below `op_timeout_s`,
        so that a frozen endpoint fails requests, and trips the breaker, within seconds, not
        when the call times out.

        Raises:
            ValueError: one of them is not below it (the message names them all).
        """
        if not max(timeouts.values()) < self.op_timeout_s:
            named = " and ".join(f"{name} ({value})" for name, value in timeouts.items())
            raise ValueError(f"{named} must be below op_timeout_s ({self.op_timeout_s})")

    @model_validator(mode="after")
    def _rules_between_keys(self) -> BlockStoreSettings:
        if self.max_backoff_s < self.backoff_s:
            raise ValueError(f"max_backoff_s ({self.max_backoff_s}) is below backoff_s ({self.backoff_s})")
        if self.encryption is not None and self.integrity is None:
            raise ValueError("encryption needs keys: set integrity (keys_env or keys_file) too")
        return self
