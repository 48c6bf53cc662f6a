"""`DaemonThreadPool`: an executor for blocking storage calls that never holds the process up.

A call into a hung NFS or FUSE mount can block its thread in the kernel for good. With
`concurrent.futures.ThreadPoolExecutor` such a thread keeps the process from exiting:
its workers are joined at interpreter exit, whatever ``shutdown(wait=False)`` said. This
pool's workers are daemon threads, which exit does not wait for; the pool itself is as
small as the stdlib's (at most `max_workers` threads, started as work comes, reused), so a
tier whose calls stop returning strands at most that many threads.

Thread: `submit` and `shutdown` from any thread.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

_Item = tuple[Future, Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class DaemonThreadPool(Executor):
    """At most `max_workers` daemon threads named ``{name}-N`` running submitted calls in
    order.

    Raises:
        ValueError: `max_workers` < 1.
    """

    def __init__(self, max_workers: int, name: str):
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self._max_workers = max_workers
        self._name = name
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._shut_down = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        """Queue ``fn(*args, **kwargs)``; a new thread starts if none is idle and fewer than
        `max_workers` run.

        Raises:
            RuntimeError: after `shutdown`.
        """
        with self._lock:
            if self._shut_down:
                raise RuntimeError("cannot schedule new futures after shutdown")
            future: Future = Future()
            self._queue.put((future, fn, args, kwargs))
            if not self._idle.acquire(blocking=False) and len(self._threads) < self._max_workers:
                thread = threading.Thread(target=self._work, name=f"{self._name}-{len(self._threads)}", daemon=True)
                thread.start()
                self._threads.append(thread)
        return future

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fn, args, kwargs = item
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(*args, **kwargs)
                except BaseException as exc:
                    future.set_exception(exc)
                else:
                    future.set_result(result)
            del item, future  # no reference to the last call's objects while idle
            self._idle.release()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Take no new calls; with `cancel_futures`, cancel those not started; threads exit
        once their current call returns. `wait`: also join them (never do that with a call
        that may not return)."""
        with self._lock:
            self._shut_down = True
            threads = list(self._threads)
        if cancel_futures:
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[0].cancel()
        for _ in threads:
            self._queue.put(None)
        if wait:
            for thread in threads:
                thread.join()
