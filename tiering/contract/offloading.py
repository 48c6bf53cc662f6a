"""`OffloadingManager`: the scheduler-facing contract every manager implements.

Every method is called from the scheduler thread only, is bookkeeping only (no I/O, no
blocking wait) and never raises because of a backend. Managers are not thread-safe.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable

from tiering.contract.keys import OffloadKey, ReqContext, RequestOffloadingContext
from tiering.contract.mediums import LoadStoreSpec, OffloadingEvent, PrepareStoreOutput


class OffloadingManager(ABC):
    """Tracks offloaded blocks for the scheduler and decides where they live."""

    @abstractmethod
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        """Whether one block is offloaded and ready to load.

        Returns:
            True if ready, False if not offloaded, None if the caller should ask again at
            a later step (a transfer of the block is in flight).
        """

    @abstractmethod
    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        """Pin blocks for loading and say where they are.

        The blocks stay protected from eviction until `complete_load`. Every key must have
        answered True to `lookup`.
        """

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Mark blocks as recently used; the first key ends up the most recent."""
        return

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Unpin blocks pinned by `prepare_load`."""
        return

    @abstractmethod
    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        """Reserve room for blocks about to be offloaded, evicting if needed.

        The reserved blocks are protected from eviction until `complete_store`.

        Returns:
            Which keys to copy and where, or None if there is not enough evictable room.
        """

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> list[OffloadKey] | None:
        """Mark blocks reserved by `prepare_store` as stored (loadable from now on).

        With ``success=False`` the blocks not yet stored are dropped. A manager may return
        the keys this call made loadable; None says nothing about them.
        """
        return None

    @abstractmethod
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        """Called when the scheduler first sees a request; says how to offload it."""

    def on_request_finished(self, req_context: ReqContext) -> None:
        """Called when a request has finished."""
        return

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Events collected since the last call (empty when events are disabled)."""
        return ()

    def on_schedule_end(self) -> None:
        """Called once at the end of every scheduler step to flush deferred work."""
        return

    def reset_cache(self) -> None:
        """Drop every tracked block and reset internal state."""
        return

    def shutdown(self) -> None:
        """Release every resource the manager holds. Safe to call more than once."""
        return
