import asyncio
import threading

import anyio
import pytest

from tiering import AsyncRuntime, RuntimeClosedError, RuntimeDeadError
from tiering.tiers.runtime import INBOX_SLICE


class CountingRuntime(AsyncRuntime):
    wakeups = 0

    async def _run_inbox(self):
        self.wakeups += 1
        await super()._run_inbox()


@pytest.fixture
def runtime():
    runtime = CountingRuntime("tiering-test")
    yield runtime
    runtime.shutdown()


def test_starts_lazily_in_a_named_daemon_thread(runtime):
    assert not any(t.name == "tiering-test" for t in threading.enumerate())
    seen = []
    done = threading.Event()
    runtime.submit(lambda: (seen.append(threading.current_thread()), done.set()))
    assert not any(t.name == "tiering-test" for t in threading.enumerate())  # queued only
    runtime.flush()
    assert done.wait(5)
    assert seen[0].name == "tiering-test" and seen[0].daemon


def test_callbacks_run_in_order_with_one_wakeup_per_flush(runtime):
    done, order = threading.Event(), []
    for i in range(100):
        runtime.submit(lambda i=i: order.append(i))
    runtime.submit(done.set)
    runtime.flush()
    runtime.flush()  # a wake-up is pending (or nothing is queued): no second one
    assert done.wait(5)
    assert order == list(range(100))
    assert runtime.wakeups == 1
    runtime.flush()  # nothing queued
    runtime.run_sync(anyio.sleep, 0)
    assert runtime.wakeups == 1


def test_tasks_the_first_callbacks_start_run_before_the_last_callbacks_of_a_large_batch(runtime):
    done, events = threading.Event(), []

    async def task(i):
        events.append(("task", i))

    def callback(i):
        events.append(("callback", i))
        asyncio.get_running_loop().create_task(task(i))

    for i in range(4 * INBOX_SLICE):
        runtime.submit(lambda i=i: callback(i))
    runtime.submit(done.set)
    runtime.flush()
    assert done.wait(5)
    callbacks = [i for kind, i in events if kind == "callback"]
    assert callbacks == list(range(4 * INBOX_SLICE))  # still in order
    assert events.index(("task", 0)) < events.index(("callback", 2 * INBOX_SLICE))


def test_callbacks_run_inside_a_task_so_anyio_works_with_sniffio_installed(runtime):
    # With sniffio importable, anyio asks it which library runs; from a bare loop callback
    # it answers "none" and every anyio call raises (the cascade then never started).
    import sniffio

    done, seen = threading.Event(), []

    def callback():
        seen.append(sniffio.current_async_library())
        seen.append(anyio.get_current_task().name)
        done.set()

    runtime.submit(callback)
    runtime.flush()
    assert done.wait(5)
    assert seen[0] == "asyncio" and seen[1]


def test_run_sync_returns_and_raises(runtime):
    async def add(a, b):
        await anyio.sleep(0)
        return a + b

    async def fail():
        raise ValueError("boom")

    assert runtime.run_sync(add, 2, 3) == 5
    with pytest.raises(ValueError, match="boom"):
        runtime.run_sync(fail)
    with pytest.raises(TimeoutError):
        runtime.run_sync(anyio.sleep, 10, timeout_s=0.05)


def test_run_sync_runs_after_every_callback_submitted_before_it_flushed_or_not(runtime):
    ran = []
    runtime.flush()  # the loop runs
    runtime.submit(lambda: ran.append("queued"))  # no flush: a polling loop would not be rung either

    async def after():
        return list(ran)

    assert runtime.run_sync(after) == ["queued"]


def test_run_sync_and_a_wakeup_draining_the_same_inbox_run_each_callback_once_in_order(runtime):
    ran = []
    runtime.run_sync(anyio.sleep, 0)  # the loop runs
    for i in range(3 * INBOX_SLICE):  # the wake-up's drain pauses after each slice; run_sync's drains the rest
        runtime.submit(lambda i=i: ran.append(i))
    runtime.flush()

    async def after():
        return list(ran)

    assert runtime.run_sync(after) == list(range(3 * INBOX_SLICE))
    assert runtime.run_sync(after) == list(range(3 * INBOX_SLICE)) and runtime.alive


def test_a_failing_callback_does_not_kill_the_loop(runtime, caplog):
    done = threading.Event()
    runtime.submit(lambda: 1 / 0)
    runtime.submit(done.set)
    runtime.flush()
    assert done.wait(5)
    assert "ZeroDivisionError" in caplog.text


def test_calls_from_the_loop_thread_are_refused(runtime):
    errors, done = [], threading.Event()

    def reenter():
        for call in (lambda: runtime.submit(print), runtime.flush, lambda: runtime.run_sync(anyio.sleep, 0)):
            try:
                call()
            except RuntimeError as exc:
                errors.append(str(exc))
        done.set()

    runtime.submit(reenter)
    runtime.flush()
    assert done.wait(5)
    assert len(errors) == 3 and all("its own loop thread" in e for e in errors)


def test_shutdown_stops_the_thread_and_refuses_more_work(runtime):
    runtime.run_sync(anyio.sleep, 0)
    runtime.shutdown()
    runtime.shutdown()
    assert not any(t.name == "tiering-test" for t in threading.enumerate())
    for call in (lambda: runtime.submit(print), lambda: runtime.run_sync(anyio.sleep, 0), runtime.acquire):
        with pytest.raises(RuntimeClosedError, match="is shut down"):
            call()


def test_last_release_shuts_down(runtime):
    runtime.acquire()
    runtime.acquire()
    runtime.run_sync(anyio.sleep, 0)
    runtime.release()
    assert runtime.run_sync(anyio.sleep, 0) is None
    runtime.release()
    with pytest.raises(RuntimeClosedError):
        runtime.submit(print)


def test_a_busy_loop_polls_and_an_idle_one_is_rung_again_nothing_is_stranded(runtime, monkeypatch):
    monkeypatch.setattr("tiering.tiers.runtime.POLL_IDLE_S", 0.02)
    done = []
    for burst in range(3):  # each burst: work while the loop polls, then a pause past its idle time
        for i in range(20):
            runtime.submit(lambda burst=burst, i=i: done.append((burst, i)))
            runtime.flush()
            threading.Event().wait(0.002)
        threading.Event().wait(0.1)
        assert done[-1] == (burst, 19)
    assert done == [(b, i) for b in range(3) for i in range(20)]


def test_the_loop_polls_while_work_is_in_flight_and_is_rung_again_after(runtime, monkeypatch):
    """A tier whose jobs outlast the idle time (writes lagging behind an overload) must not
    make the scheduler ring: its flush would be a system call on the scheduler thread."""
    monkeypatch.setattr("tiering.tiers.runtime.POLL_IDLE_S", 0.02)
    runtime.submit(runtime.job_started)
    runtime.flush()
    threading.Event().wait(0.2)  # ten idle times with a job running and nothing submitted
    assert runtime._polling
    runtime.submit(runtime.job_finished)
    runtime.flush()
    deadline = threading.Event()
    for _ in range(500):
        if not runtime._polling:
            break
        deadline.wait(0.01)
    assert not runtime._polling


def kill_loop(runtime):
    """End the loop thread the way a bug would: an error that escapes the loop."""

    def escape():
        raise SystemExit("a bug")

    runtime.submit(escape)
    runtime.flush()
    while runtime.alive:  # the thread ends as soon as the error has unwound the loop
        threading.Event().wait(0.01)


def test_a_loop_thread_that_dies_is_logged_and_never_waited_on(runtime, caplog):
    runtime.run_sync(anyio.sleep, 0)  # running
    kill_loop(runtime)
    assert "the event loop thread died" in caplog.text and "a bug" in caplog.text
    with pytest.raises(RuntimeDeadError):
        runtime.submit(print)
    with pytest.raises(RuntimeDeadError):
        runtime.flush()
    with pytest.raises(RuntimeDeadError):
        runtime.run_sync(anyio.sleep, 0)  # no timeout: it would wait forever on a dead loop
    assert isinstance(RuntimeDeadError("x"), RuntimeClosedError)  # callers that handle a closed runtime cope
    runtime.shutdown()  # returns at once


def test_a_blocking_call_in_flight_ends_when_the_loop_thread_dies(runtime):
    started, outcome = threading.Event(), []

    async def forever():
        started.set()
        await anyio.sleep_forever()

    def call():
        try:
            runtime.run_sync(forever)
        except RuntimeDeadError as exc:
            outcome.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    assert started.wait(10)
    kill_loop(runtime)
    caller.join(60)
    assert not caller.is_alive() and len(outcome) == 1
