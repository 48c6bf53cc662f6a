"""`RequestTimeline`: where each request's time went inside the engine, one JSON line per
request in a file (the ``request_log`` setting; off by default).

When a request finishes, its line gives times in seconds of ``time.monotonic`` (the
system-wide monotonic clock: a client on the same machine reads the same one) and counts
of scheduler steps (`on_schedule_end` calls):

- ``req_id``; ``first_lookup``: its first lookup; ``finished``;
- ``load_prepared``: the `prepare_load` of its hits (every lookup it needed answered), and
  ``steps_to_load``: steps from the first lookup to then (each one a deferral: a promotion
  or a GPU store of its blocks was in flight);
- ``load_completed``: the `complete_load` of those hits (the worker's copy reported done),
  and ``steps_loading``;
- ``blocks_loaded``; ``blocks_pending``: those loaded while their promotion still ran (hits
  answered in the step they were found, behind the engine's vLLM connector), and
  ``rows_wait_s``: how long the worker's load waited for them to land (null if it did not);
- ``promotions``: per secondary tier, the seconds from the request's first lookup of a
  block of that tier to the promotion job's report (the last one, if several), and
  ``promoted_blocks``: per secondary tier, how many blocks its promotions brought to the
  CPU tier.

A field is null when its event did not happen (nothing hit: no load; no lookup: a request
the GPU prefix cache served whole, which vLLM never asks the engine about). Every finished
request writes its line.

Thread: the scheduler thread only. A finished request costs one short write to the file; a
write that fails is logged once and the log is switched off.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tiering.cpu.request_access import per_request

logger = logging.getLogger(__name__)


@dataclass
class _Request:
    req_id: str
    first_lookup: float | None = None
    first_lookup_step: int = 0  # steps are counted here, written as differences
    load_step: int = 0
    load_prepared: float | None = None
    steps_to_load: int | None = None
    load_completed: float | None = None
    steps_loading: int | None = None
    blocks_loaded: int = 0
    blocks_pending: int = 0
    rows_wait_s: float | None = None
    promotions: dict[str, float] = field(default_factory=dict)
    promoted_blocks: dict[str, int] = field(default_factory=dict)
    finished: float | None = None


class RequestTimeline:
    """The per-request log (see the module docstring)."""

    def __init__(self, path: str | Path, clock: Callable[[], float] = time.monotonic, max_requests: int = 4096):
        """
        Args:
            path: the JSON Lines file, appended to (made if missing).
            clock: seconds, monotonic (tests pass their own).
            max_requests: requests remembered at once; the oldest unfinished one is dropped
                without a line past that (a scheduler that never reports finished requests).

        Raises:
            OSError: the file cannot be opened for appending.
        """
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed by close())
        self._clock = clock
        self._max_requests = max_requests
        self._requests: dict[str, _Request] = {}
        self._step = 0

    def _request(self, req_id: str) -> _Request:
        return per_request(self._requests, req_id, lambda: _Request(req_id), self._max_requests)

    def looked_up(self, req_id: str) -> None:
        """A lookup for request `req_id` (only the first one is kept). Never raises."""
        request = self._requests.get(req_id) or self._request(req_id)
        if request.first_lookup is None:
            request.first_lookup, request.first_lookup_step = self._clock(), self._step

    def load_prepared(self, req_id: str, blocks: int, pending: int = 0) -> None:
        """`prepare_load` of `blocks` blocks for `req_id`, `pending` of them still being
        promoted. Never raises."""
        request = self._request(req_id)
        request.blocks_pending += pending
        request.load_prepared = self._clock()
        request.steps_to_load = self._step - request.first_lookup_step if request.first_lookup is not None else 0
        request.blocks_loaded += blocks
        request.load_step = self._step

    def load_completed(self, req_id: str) -> None:
        """`complete_load` for `req_id` (ignored without a load prepared). Never raises."""
        request = self._requests.get(req_id)
        if request is not None and request.load_prepared is not None:
            request.load_completed = self._clock()
            request.steps_loading = self._step - request.load_step

    def load_waited(self, req_id: str, seconds: float) -> None:
        """The worker's load for `req_id` waited `seconds` for promoted rows (the longest of
        its workers'). Never raises."""
        request = self._requests.get(req_id)
        if request is not None:
            request.rows_wait_s = max(seconds, request.rows_wait_s or 0.0)

    def promoted(self, req_id: str, tier: str, blocks: int) -> None:
        """A promotion job `req_id` queued on `tier` (its name) was reported, `blocks` of its
        blocks now in the CPU tier. Never raises."""
        request = self._requests.get(req_id)
        if request is not None and request.first_lookup is not None:
            request.promotions[tier] = self._clock() - request.first_lookup
            request.promoted_blocks[tier] = request.promoted_blocks.get(tier, 0) + blocks

    def step_ended(self) -> None:
        """One scheduler step (`on_schedule_end`) ended."""
        self._step += 1

    def finished(self, req_id: str) -> None:
        """Write `req_id`'s line and forget it (nothing once the log is off). Never raises: a
        failed write is logged once and turns the log off."""
        request = self._requests.pop(req_id, None) or _Request(req_id)  # unknown: no lookup, no load
        if self._file.closed:
            return
        request.finished = self._clock()
        line = asdict(request)
        del line["first_lookup_step"], line["load_step"]
        try:
            self._file.write(json.dumps(line) + "\n")
            self._file.flush()
        except (OSError, ValueError) as exc:
            logger.error("request_log: cannot write (%s); the log is off from now on", exc)
            self.close()

    def close(self) -> None:
        """Close the file (requests not finished write nothing). Never raises: a failing
        flush loses the lines not written yet, the file is closed all the same."""
        with contextlib.suppress(OSError):
            self._file.close()
