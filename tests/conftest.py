import threading

import pytest

from tiering import ReqContext


@pytest.fixture
def ctx() -> ReqContext:
    return ReqContext("req-0")


@pytest.fixture(autouse=True)
def no_leaked_threads():
    """Every test must stop the runtimes and thread pools it started."""
    before = set(threading.enumerate())
    yield
    for thread in threading.enumerate():
        if thread not in before and thread.name.startswith("tiering"):
            thread.join(5)  # pools wind down asynchronously after shutdown(wait=False)
    leaked = [t.name for t in threading.enumerate() if t not in before and t.name.startswith("tiering")]
    assert leaked == [], f"threads left running: {leaked}"
