import pytest

from tiering import ReqContext


@pytest.fixture
def ctx() -> ReqContext:
    return ReqContext("req-0")
