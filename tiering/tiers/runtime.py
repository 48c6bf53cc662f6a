"""`AsyncRuntime`: one asyncio event loop in a daemon thread, fed from the scheduler thread.

The scheduler thread hands work to the loop with `submit(callback)`, a deque append, and
rings the loop with `flush()` once per batch (a scheduler step): one `call_soon_threadsafe`,
skipped when a wake-up is already pending. Waking the loop per job would cost a GIL handoff
to the loop thread per job. Callbacks run on the loop thread in submission order, inside
the runtime's pump task (never as bare loop callbacks, where anyio cannot tell which async
library runs once `sniffio` is installed); they typically start tasks, which take a step
after every `INBOX_SLICE` callbacks.
Blocking calls into the loop (`run_sync`) are for construction and shutdown only.

While work keeps coming, the loop polls the inbox every `POLL_S` instead of being rung, and
`flush()` does nothing: ringing is a system call (a socket write), which releases the GIL,
and getting it back from a busy loop or I/O thread can take a whole switch interval (5 ms),
the scheduler's worst latency under load. After `POLL_IDLE_S` without work the loop goes
back to waiting for a ring. A job in flight counts as work: while a tier's job runs
(`job_started` .. `job_finished`), the loop keeps polling, so a tier whose writes lag behind
the scheduler (an overload, when the scheduler's latency matters most) is never rung, even
when the scheduler submits nothing new for a while. (A call that never returns ends its job
at the tier's ``op_timeout_s``, so polling always stops.) Polling costs about 7% of one core
of a 2-core VM (2,000 wake-ups a second); waiting for a ring costs nothing.

If the loop thread dies (an error escaped the loop: a bug), its cause is logged, `alive`
turns False and every later call raises `RuntimeDeadError` at once: nothing waits on a loop
that will never run it (jobs already handed over are failed by the manager's deadline).

Tiers share a runtime by reference counting: each tier `acquire`s it when built and
`release`s it at shutdown; the last release stops the loop and joins the thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
from anyio.abc import TaskGroup

from tiering.errors import RuntimeClosedError, RuntimeDeadError

logger = logging.getLogger(__name__)

T = TypeVar("T")
POLL_S = 0.0005  # while busy, the loop looks at the inbox this often, seconds
POLL_IDLE_S = 0.05  # and goes back to waiting for a ring after this long without work
INBOX_SLICE = 16
"""The loop runs at most this many queued callbacks before the tasks they started take a step:
the first jobs of a large step reach their stores while the rest are still being started. A
block-store tier's store (or load) jobs queued within one slice start together."""
_DEATH_CHECK_S = 0.1  # a blocking call looks this often whether the loop thread died


@dataclass(frozen=True)
class _Running:
    """What exists while the loop runs (made on the loop thread, all at once)."""

    loop: asyncio.AbstractEventLoop
    task_group: TaskGroup
    stop: anyio.Event
    wake: asyncio.Event


class AsyncRuntime:
    """An event loop in a named daemon thread, started on first use."""

    def __init__(self, name: str = "tiering-io", start_timeout_s: float = 10.0):
        """
        Args:
            name: the loop thread's name.
            start_timeout_s: how long the first call waits for the loop to start, seconds.
        """
        self.name = name
        self._start_timeout_s = start_timeout_s
        self._inbox: deque[Callable[[], None]] = deque()
        self._ring_pending = False
        self._polling = False  # the loop looks at the inbox by itself: no ring needed
        self._jobs_in_flight = 0  # jobs between `job_started` and `job_finished`
        self._active_at = 0.0  # loop clock when a job last finished
        self._users = 0
        self._closed = False
        self._start_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._running: _Running | None = None

    # -- use from any thread but the loop's ------------------------------------------------

    def acquire(self) -> AsyncRuntime:
        """Register one more user (a tier). Returns self.

        Raises:
            RuntimeClosedError: the runtime was shut down.
        """
        if self._closed:
            raise RuntimeClosedError(f"runtime {self.name} is shut down")
        self._users += 1
        return self

    def release(self, timeout_s: float = 10.0) -> None:
        """Drop one user; the last one shuts the runtime down (see `shutdown`)."""
        self._users -= 1
        if self._users <= 0:
            self.shutdown(timeout_s)

    @property
    def alive(self) -> bool:
        """False once the loop thread has died (see the module docstring) or the runtime was
        shut down; True before the loop first starts. Any thread; never raises."""
        return not self._closed and (self._thread is None or self._thread.is_alive())

    def submit(self, callback: Callable[[], None]) -> None:
        """Queue `callback()` to run on the loop thread at the next `flush`, after every
        callback queued before it. Costs a deque append.

        Raises:
            RuntimeClosedError: the runtime was shut down.
            RuntimeDeadError: its loop thread died.
            RuntimeError: called from the loop thread itself.
        """
        self._check_caller()
        self._inbox.append(callback)

    def flush(self) -> None:
        """Wake the loop to run the queued callbacks: at most one wake-up, none if nothing is
        queued or a wake-up is already pending. Starts the loop on first use.

        Raises:
            RuntimeClosedError: the runtime was shut down.
            RuntimeDeadError: its loop thread died.
            RuntimeError: called from the loop thread itself.
        """
        self._check_caller()
        if self._inbox and not self._ring_pending and not self._polling:
            running = self._running or self._start()
            self._ring_pending = True
            running.loop.call_soon_threadsafe(running.wake.set)

    def run_sync(self, func: Callable[..., Coroutine[Any, Any, T]], *args: Any, timeout_s: float | None = None) -> T:
        """Run ``await func(*args)`` on the loop, after every callback submitted before this
        call (flushed or not: a loop that polls may not have seen them yet), and block until
        it returns.

        Returns what it returns; raises what it raises.

        Raises:
            RuntimeClosedError: the runtime was shut down.
            RuntimeDeadError: its loop thread died (also while this call waited).
            RuntimeError: called from the loop thread itself (it would deadlock).
            TimeoutError: it took longer than `timeout_s` seconds (it is cancelled).
        """
        self._check_caller()
        running = self._running or self._start()
        future = asyncio.run_coroutine_threadsafe(self._after_queued(func, args), running.loop)
        try:
            return self._result(future, timeout_s)
        except BaseException:  # a timeout, or the caller interrupted (SIGTERM, Ctrl-C): stop the coroutine too
            future.cancel()
            raise

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Cancel every task, stop the loop and join its thread (up to `timeout_s` seconds).

        Later calls do nothing. Callbacks still queued are dropped.

        Raises:
            RuntimeError: called from the loop thread itself.
        """
        if self._closed:
            return
        self._check_caller(alive=False)
        self._closed = True
        running, thread = self._running, self._thread
        if running is None or thread is None or not thread.is_alive():  # never started, or died
            return
        running.loop.call_soon_threadsafe(running.stop.set)
        thread.join(timeout_s)
        if thread.is_alive():
            logger.warning("runtime %s: loop thread still running after %.1f s", self.name, timeout_s)

    # -- use from the loop thread ----------------------------------------------------------

    @property
    def task_group(self) -> TaskGroup:
        """The root task group, for tasks that live as long as the runtime (loop thread)."""
        assert self._running is not None, "the runtime is not running"
        return self._running.task_group

    def job_started(self) -> None:
        """Count a job (a tier's store call) as running: until its `job_finished`, the loop
        polls its inbox rather than wait for a ring. Loop thread; never raises."""
        self._jobs_in_flight += 1

    def job_finished(self) -> None:
        """End a job `job_started` counted; the loop polls `POLL_IDLE_S` more after the
        last one, since its outcome usually brings new work. Loop thread.

        Raises:
            RuntimeError: called where no event loop runs (off the loop thread).
        """
        self._jobs_in_flight -= 1
        self._active_at = asyncio.get_running_loop().time()

    def in_loop_thread(self) -> bool:
        """Whether the caller runs on the loop thread."""
        return self._thread is not None and threading.current_thread() is self._thread

    # -- internals -------------------------------------------------------------------------

    def _check_caller(self, alive: bool = True) -> None:
        """Raise unless the caller may use the runtime: open, off the loop thread, and (with
        `alive`) its loop thread not dead."""
        if self._closed:
            raise RuntimeClosedError(f"runtime {self.name} is shut down")
        if alive and not self.alive:
            raise RuntimeDeadError(f"runtime {self.name}: its loop thread died (the log says why)")
        if self.in_loop_thread():
            raise RuntimeError(f"runtime {self.name}: called from its own loop thread; use the loop directly")

    def _start(self) -> _Running:
        with self._start_lock:
            if self._closed:
                raise RuntimeClosedError(f"runtime {self.name} is shut down")
            if self._running is None:
                started = threading.Event()
                self._thread = threading.Thread(target=self._run, args=(started,), name=self.name, daemon=True)
                self._thread.start()
                if not started.wait(self._start_timeout_s) or self._running is None:
                    raise RuntimeError(f"runtime {self.name}: loop did not start in {self._start_timeout_s} s")
        return self._running

    def _run(self, started: threading.Event) -> None:
        """The loop thread: the loop until `shutdown`; an error that escapes it is logged."""
        try:
            anyio.run(self._main, started)
        except BaseException:
            logger.exception("runtime %s: the event loop thread died; its tiers fail their jobs from now on", self.name)

    def _result(self, future: Future[T], timeout_s: float | None) -> T:
        """`future`'s result, waited for in slices so that a loop thread that dies meanwhile
        ends the wait at once."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left = _DEATH_CHECK_S if deadline is None else min(_DEATH_CHECK_S, deadline - time.monotonic())
            try:
                return future.result(max(0.0, left))
            except TimeoutError:
                if deadline is not None and time.monotonic() >= deadline:
                    raise
                if not self.alive and not future.done():
                    raise RuntimeDeadError(f"runtime {self.name}: its loop thread died") from None
            except CancelledError:  # by the loop's end: a shutdown, or the thread dying (join: which)
                if self._thread is not None and not self._closed:
                    self._thread.join(_DEATH_CHECK_S)
                    if not self._thread.is_alive():
                        raise RuntimeDeadError(f"runtime {self.name}: its loop thread died") from None
                raise

    async def _main(self, started: threading.Event) -> None:
        async with anyio.create_task_group() as task_group:
            running = _Running(asyncio.get_running_loop(), task_group, anyio.Event(), asyncio.Event())
            self._running = running
            task_group.start_soon(self._pump, running.wake)
            started.set()
            await running.stop.wait()
            task_group.cancel_scope.cancel()

    async def _pump(self, wake: asyncio.Event) -> None:
        """Run the inbox at every wake-up, then poll it while work keeps coming, as a task
        (see the module docstring)."""
        loop = asyncio.get_running_loop()
        while True:
            await wake.wait()
            wake.clear()
            await self._run_inbox()
            self._polling, last_work = True, loop.time()
            while True:
                await asyncio.sleep(POLL_S)
                if self._inbox:
                    await self._run_inbox()
                    last_work = loop.time()
                elif not self._jobs_in_flight and loop.time() - max(last_work, self._active_at) > POLL_IDLE_S:
                    self._polling = False
                    if not self._inbox:  # checked after clearing the flag: a flush now rings
                        break

    async def _run_inbox(self) -> None:
        """Run the queued callbacks in order, letting the tasks they start take a step after
        every `INBOX_SLICE` of them. A wake-up stays pending until the inbox is empty: what a
        flush queues meanwhile runs in this drain, with no ring (a socket write on the
        scheduler thread); what it queues after the drain, the polling that follows picks up."""
        inbox = self._inbox
        ran = 0
        while inbox:
            if ran == INBOX_SLICE:
                await asyncio.sleep(0)
                ran = 0
                continue  # (a `run_sync` may have drained the rest meanwhile)
            ran += 1
            self._run_callback(inbox.popleft())
        self._ring_pending = False

    async def _after_queued(self, func: Callable[..., Coroutine[Any, Any, T]], args: tuple[Any, ...]) -> T:
        """``await func(*args)`` once every callback queued before it ran (`run_sync`)."""
        inbox = self._inbox
        while inbox:
            self._run_callback(inbox.popleft())
        return await func(*args)

    def _run_callback(self, callback: Callable[[], None]) -> None:
        try:
            callback()
        except Exception:
            logger.exception("runtime %s: callback %r failed", self.name, callback)
