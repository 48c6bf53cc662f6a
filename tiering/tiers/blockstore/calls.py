"""`StoreCalls`: a block-store tier's calls into its store, each answered within a timeout.

Loop thread only. A call runs in a task of its own, within its lane's limit (an
`asyncio.Semaphore` of the worker); the caller gets its result, the exception it raised, or a
`HungCallError` at the timeout, which counts from when the call holds its lane (one queued
behind a call stuck in its store waits; its job's deadline, the manager's `job_deadline_s`,
bounds it). A call that does not end when cancelled (its thread is stuck
in a system call, and may still write into the rows it was given) counts in ``hung`` of every
job it served until it returns.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import anyio

from tiering.errors import HungCallError
from tiering.tiers.blockstore.outbox import JobDone, Outbox, RowsReleased

T = TypeVar("T")


class StoreCalls:
    """Store calls under `op_timeout_s`; `running` holds a task per call until it returns
    (the worker waits for them before it closes the store)."""

    def __init__(self, op_timeout_s: float, outbox: Outbox):
        self.op_timeout_s = op_timeout_s
        self._outbox = outbox
        self.running: set[asyncio.Task[None]] = set()

    async def call(
        self,
        dones: Sequence[JobDone],
        lane: asyncio.Semaphore,
        operation: Callable[..., Awaitable[T]],
        *args: Any,
    ) -> T | Exception:
        """``await operation(*args)`` within `lane`'s limit: the result, the exception it
        raised, or a `HungCallError` if it gave no answer in `op_timeout_s` from the moment
        it held the lane (time queued behind other calls is no sign of a hung backend).

        At the timeout (or when the caller is cancelled) the call is cancelled through its
        own anyio scope, which a store's shield respects. A call that has not returned then
        counts in ``hung`` of each of `dones` (the jobs whose blocks it moves) until it
        returns: a job reported meanwhile is reported with ``rows_in_use``, and a
        `RowsReleased` follows when the last such call returns.
        """
        loop = asyncio.get_running_loop()
        answered: asyncio.Future[bool] = loop.create_future()  # settled: the call ended, or its timeout
        scope = anyio.CancelScope()
        result: list[T | Exception] = []
        timer: list[asyncio.TimerHandle] = []  # started once the lane is held
        late = False

        async def call() -> None:
            try:
                with scope:
                    async with lane:
                        timer.append(loop.call_later(self.op_timeout_s, _answer, answered, False))
                        result.append(await operation(*args))
            except Exception as exc:
                result.append(exc)
            finally:
                _answer(answered, True)
                if late:
                    for done in dones:
                        self._hung_call_returned(done)

        task = loop.create_task(call())
        self.running.add(task)
        task.add_done_callback(self.running.discard)
        try:
            await answered
        finally:
            for handle in timer:
                handle.cancel()
            # it returned if and only if it delivered its result: one that returns in the
            # turn its timeout fires (before this resumes) is not hung
            if not result:  # timed out, or the caller was cancelled (shutdown)
                scope.cancel()
                late = True
                for done in dones:
                    done.hung += 1
        return result[0] if result else HungCallError(f"no answer in {self.op_timeout_s} s")

    def _hung_call_returned(self, done: JobDone) -> None:
        done.hung -= 1
        if done.hung == 0 and done.reported and done.rows_in_use:
            self._outbox.put(RowsReleased(job_id=done.job_id), task_finished=False)


def _answer(answered: asyncio.Future[bool], returned: bool) -> None:
    """Settle `answered` unless it is settled (or cancelled with the task awaiting it)."""
    if not answered.done():
        answered.set_result(returned)
