"""A request's ``kv_load_tiers`` (`tiering.engine.load_tiers`): the secondary tiers it may
load from, by medium, locality and owner; the CPU tier always serves it."""

import pytest

from tests.helpers import keys
from tiering import ReqContext


def request(load_tiers, req_id="r"):
    return ReqContext(req_id, kv_transfer_params={"kv_load_tiers": load_tiers})


def found(engine, ctx, *ids):
    """The engine's answers for `ids` once its promotions settle (as `lookup_until_done`)."""
    engine.manager.on_new_request(ctx)
    for _ in range(5):
        answers = [engine.manager.lookup(k, ctx) for k in keys(*ids)]
        engine.settle()
        if None not in answers:
            return answers
    raise AssertionError("still in flight")


@pytest.mark.parametrize(
    ("load_tiers", "loads", "logged"),
    [
        ([{"medium": "storage"}], True, False),
        ([{"medium": "STORAGE", "locality": "local"}], True, False),
        ([{"owner": "memory"}], True, False),
        ([{"medium": "cpu"}], False, False),
        ([{"locality": "remote"}], False, False),
        ([{"owner": "s3"}], False, False),
        ([], False, False),
        ("storage", True, True),  # not a list: ignored, logged
        ([{"medium": "x" * 1000}], True, True),  # too long: ignored, logged
        ([{str(i): 1 for i in range(100_000)}], True, True),  # too many keys: refused before they are read
    ],
)
def test_a_request_loads_only_from_the_tiers_its_kv_load_tiers_allow(engine_factory, load_tiers, loads, logged, caplog):
    engine = engine_factory({"type": "memory"}, num_blocks=4)
    engine.store(0, 1)
    engine.store(4, 5, 6, 7)  # 0 and 1 only in the memory tier now
    assert found(engine, request(load_tiers), 0, 1) == [loads, loads]
    if logged:
        assert "kv_load_tiers ignored" in caplog.text


def test_the_cpu_tier_serves_whatever_the_request_allows(engine_factory):
    engine = engine_factory({"type": "memory"}, num_blocks=4)
    engine.store(0, 1)
    assert found(engine, request([]), 0, 1) == [True, True]


def test_a_tier_that_does_not_say_its_medium_or_locality_takes_the_defaults():
    """A tier need not subclass SecondaryTierManager (the engine calls what it has): it is
    STORAGE and LOCAL, and a request's kv_load_tiers never fails on it."""
    from tiering.engine.load_tiers import allowed_tiers, tier_places

    class DuckTier:
        pass

    places = tier_places([DuckTier(), DuckTier()], ["a", "b"])
    ctx = request([{"medium": "storage", "locality": "local"}, {"owner": "b"}])
    assert allowed_tiers(ctx, places) == frozenset({0, 1})
    assert allowed_tiers(request([{"locality": "remote"}]), places) == frozenset()


@pytest.mark.parametrize(("medium", "locality"), [("GPU", "LOCAL"), ("STORAGE", "nearby"), (None, "LOCAL")])
def test_a_tier_that_declares_a_medium_or_locality_vllm_has_not_is_refused_by_name(medium, locality):
    """vLLM's events and tier filters know CPU and STORAGE, LOCAL and REMOTE: a tier saying
    otherwise is refused when the manager is built, not when its first event is published."""
    from tiering.engine.load_tiers import tier_places

    class OddTier:
        pass

    tier = OddTier()
    tier.medium, tier.locality = medium, locality
    with pytest.raises(ValueError, match=r"tier odd: medium .* expected a medium of CPU, STORAGE and a locality of"):
        tier_places([tier], ["odd"])
    tier.medium, tier.locality = "storage", "remote"  # any case
    assert tier_places([tier], ["odd"]) == [("STORAGE", "REMOTE", "odd")]
