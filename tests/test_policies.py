from itertools import islice

import numpy as np
import pytest

from tests.helpers import key, keys
from tiering import ARCCachePolicy, LRUCachePolicy, make_cache_policy
from tiering.eviction.policies import BlockStatus


def fill(policy, *ids, ref_cnt=0):
    for i in ids:
        block = BlockStatus(i)
        block.ref_cnt = ref_cnt
        policy.insert(key(i), block)


def evicted_ids(victims):
    return [block.block_id for _, block in victims]


def test_registry_builds_by_name():
    assert isinstance(make_cache_policy("lru", 4), LRUCachePolicy)
    assert isinstance(make_cache_policy("arc", 4), ARCCachePolicy)


def test_unknown_policy_lists_known_ones():
    with pytest.raises(ValueError, match=r"unknown cache policy 'fifo'; known policies: arc, arc-s, lru"):
        make_cache_policy("fifo", 4)


@pytest.mark.parametrize("name", ["lru", "arc", "arc-s"])
def test_evicts_least_recent_first(name):
    policy = make_cache_policy(name, 4)
    fill(policy, 0, 1, 2, 3)
    assert evicted_ids(policy.evict(2, protected=())) == [0, 1]
    assert len(policy) == 2
    assert policy.get(key(0)) is None and policy.get(key(2)) is not None


@pytest.mark.parametrize("name", ["lru", "arc", "arc-s"])
def test_never_evicts_pinned_in_flight_or_protected_blocks(name):
    policy = make_cache_policy(name, 4)
    fill(policy, 0)  # idle
    fill(policy, 1, ref_cnt=2)  # being read
    fill(policy, 2, ref_cnt=-1)  # write in flight
    fill(policy, 3)  # idle but protected
    assert evicted_ids(policy.evict(1, protected={key(3)})) == [0]
    assert policy.evict(1, protected={key(3)}) is None


@pytest.mark.parametrize("name", ["lru", "arc", "arc-s"])
def test_evict_is_all_or_nothing(name):
    policy = make_cache_policy(name, 4)
    fill(policy, 0, 1)
    fill(policy, 2, ref_cnt=1)
    assert policy.evict(3, protected=()) is None
    assert len(policy) == 3


@pytest.mark.parametrize("name", ["lru", "arc", "arc-s"])
def test_touch_leaves_first_key_most_recent(name):
    policy = make_cache_policy(name, 8)
    fill(policy, 0, 1, 2, 3, 4)
    policy.touch(keys(2, 1, 0))
    # 3 and 4 untouched (oldest first), then the touched ones with 2, the first, most recent.
    assert evicted_ids(policy.evict(5, protected=())) == [3, 4, 0, 1, 2]


@pytest.mark.parametrize("name", ["lru", "arc", "arc-s"])
def test_a_finished_request_ranks_its_head_most_recent(name):
    policy = make_cache_policy(name, 8)
    fill(policy, 3, 2, 1, 0, 9)  # reserved tail first, as a set might complete them
    policy.on_request_finished(keys(0, 1, 2, 3), inserted=set(keys(0, 1, 2, 3)), reused=set())
    assert evicted_ids(policy.evict(5, protected=())) == [9, 3, 2, 1, 0]


@pytest.mark.parametrize("name", ["lru", "arc", "arc-s"])
def test_touch_ignores_unknown_keys_and_remove_forgets(name):
    policy = make_cache_policy(name, 4)
    fill(policy, 0, 1)
    policy.touch(keys(7))
    assert policy.remove(key(0)).block_id == 0
    assert policy.remove(key(0)) is None
    assert sorted(b.block_id for _, b in policy.items()) == [1]


def test_lru_has_no_scan_resistance():
    policy = LRUCachePolicy(4)
    fill(policy, 0, 1)
    policy.touch(keys(0))
    policy.touch(keys(0))
    fill(policy, 10, 11)
    assert evicted_ids(policy.evict(2, protected=())) == [1, 0]


def test_arc_block_used_twice_survives_a_scan():
    policy = ARCCachePolicy(4)
    fill(policy, 0, 1)
    policy.touch(keys(0))  # 0 moves to the frequent list
    evicted = []
    for scan in range(10, 20):  # a scan of blocks used once
        if len(policy) == 4:
            evicted += evicted_ids(policy.evict(1, protected=()))
        fill(policy, scan)
    assert 0 not in evicted
    assert 1 in evicted
    assert policy.get(key(0)) is not None


def test_arc_store_miss_on_a_b1_ghost_grows_the_target_and_the_block_enters_t2():
    policy = ARCCachePolicy(2)
    fill(policy, 0, 1)
    assert evicted_ids(policy.evict(1, protected=())) == [0]  # 0 goes to ghost list B1
    assert policy.target_t1_size == 0
    policy.on_store_miss(keys(0))  # a request stores 0 again: B1 hit, T1's target grows
    assert policy.target_t1_size == 1
    fill(policy, 0)  # its second use: T2 (vLLM's ARC puts it in T1)
    assert list(policy._t2) == keys(0) and not policy._b1
    fill(policy, 2)
    # T1 = [1, 2] holds its target, so its oldest entry goes before the frequent block 0.
    assert evicted_ids(policy.evict(1, protected=())) == [1]


def test_arc_b2_ghost_shrinks_target():
    policy = ARCCachePolicy(2)
    fill(policy, 0, 1)
    policy.touch(keys(0))  # T1 = [1], T2 = [0]
    policy.target_t1_size = 2.0  # T1 is below its target, so the frequent list gives
    assert evicted_ids(policy.evict(1, protected=())) == [0]  # 0 -> ghost list B2
    policy.on_store_miss(keys(0))  # shrinks T1's target by max(1, |B1| / |B2|)
    assert policy.target_t1_size == 1.0
    fill(policy, 0)  # back into T2
    # T1 = [1] now holds its target, so it gives the next victim.
    assert evicted_ids(policy.evict(1, protected=())) == [1]


def test_arc_reuse_moves_to_t2_a_store_does_not_and_a_write_in_flight_is_no_reuse():
    policy = ARCCachePolicy(8)
    fill(policy, 0, 1, 2)
    fill(policy, 3, ref_cnt=-1)
    policy.touch(keys(3))  # still being written: stays in T1, most recent there
    policy.on_request_finished(keys(0, 1, 2), inserted={key(1), key(2)}, reused={key(0), key(2)})
    assert list(policy._t2) == keys(2, 0)  # reused, head most recent
    assert list(policy._t1) == [key(3), key(1)]


def test_arc_ghost_lists_are_bounded():
    policy = ARCCachePolicy(2)
    for i in range(50):
        fill(policy, i)
        if len(policy) == 2:
            policy.evict(1, protected=())
    assert len(policy._b1) <= 2 and len(policy._b2) <= 2


def test_arc_evicts_exactly_the_blocks_its_victim_order_names_whatever_the_state():
    """`evict` takes a shortcut when all victims come from one list; on random states (lists
    above and below the target, busy and protected blocks, ghost hits) it must evict what
    the general block-by-block order names, into the right ghost list."""
    rng = np.random.default_rng(3)
    policy = ARCCachePolicy(12)
    universe = [key(i) for i in range(40)]
    checked = 0
    for _ in range(3000):
        chosen = [universe[int(i)] for i in rng.choice(40, size=int(rng.integers(1, 5)), replace=False)]
        for _, block in policy.items():  # transfers end
            if rng.integers(0, 4) == 0:
                block.ref_cnt = 0
        if rng.integers(0, 3) == 0:
            policy.touch(chosen)
            continue
        new = [k for k in chosen if policy.get(k) is None]
        protected = {universe[int(i)] for i in rng.choice(40, size=int(rng.integers(0, 4)), replace=False)} | set(new)
        room = policy.capacity - len(policy)
        if len(new) > room:
            expected = list(islice(policy._victims(protected), len(new) - room))
            victims = policy.evict(len(new) - room, protected)
            if len(expected) < len(new) - room:
                assert victims is None
                continue
            assert victims == [(k, b) for k, b, _ in expected]
            assert all((k in policy._b1) == in_t1 and (k in policy._b2) != in_t1 for k, _, in_t1 in expected)
            checked += 1
        for k in new:
            block = BlockStatus(int(rng.integers(0, 99)))
            block.ref_cnt = int(rng.choice([0, 0, 0, 1, -1]))
            policy.insert(k, block)
    assert checked > 200


def finish_request(policy, *ids):
    """A request that offered or loaded `ids` (head first) finishes."""
    policy.on_request_finished(keys(*ids), inserted=set(), reused=set())


def test_arc_s_learns_reuse_from_requests_even_when_the_block_was_evicted_between_them():
    policy = make_cache_policy("arc-s", 2)  # ghost lists of one key
    fill(policy, 0)
    finish_request(policy, 0)  # counted once: the "once" list
    fill(policy, 1)
    finish_request(policy, 1)
    assert evicted_ids(policy.evict(1, protected=())) == [0]
    fill(policy, 2)
    finish_request(policy, 2)
    policy.evict(1, protected=())  # 1 evicted: 0 is no longer remembered as a ghost
    assert list(policy._b1) == keys(1)
    fill(policy, 0)  # a new block to the "once" list: nothing remembers it...
    assert list(policy._t1) == keys(2, 0)
    finish_request(policy, 0)  # ...but the sketch does: its second request
    assert list(policy._t2) == keys(0)
    for scan in range(10, 20):  # a scan of blocks used once never evicts it
        if len(policy) == 2:
            assert evicted_ids(policy.evict(1, protected=())) != [0]
        fill(policy, scan)
        finish_request(policy, scan)
    assert policy.get(key(0)) is not None


def test_arc_s_counts_once_per_request_and_forgets_by_halving():
    policy = make_cache_policy("arc-s", 2)  # halves after 20 increments
    fill(policy, 0)
    finish_request(policy, 0)
    finish_request(policy, 0)  # a second request: "repeat"
    assert list(policy._t2) == keys(0)
    for other in range(100, 118):  # 20 increments: 0's count 2 -> 1 (at the last of them)
        finish_request(policy, other)
    assert policy.sketch.count(key(0)) == 1
    for other in range(200, 220):  # 1 -> 0
        finish_request(policy, other)
    finish_request(policy, 0)  # counted once again: back to "once"
    assert list(policy._t1) == keys(0) and not policy._t2


def test_arc_s_ghost_hits_move_the_target_by_four_within_bounds():
    policy = make_cache_policy("arc-s", 6)
    fill(policy, 0, 1)
    finish_request(policy, 1)
    finish_request(policy, 1)  # 1 in "repeat", 0 in "once"
    assert evicted_ids(policy.evict(1, protected=())) == [0]  # "once" is over its target of 0
    policy.on_store_miss(keys(0))
    assert policy.target_t1_size == 4
    policy.on_store_miss(keys(0))
    assert policy.target_t1_size == 6  # at most the capacity
    policy.target_t1_size = 2
    assert evicted_ids(policy.evict(1, protected=())) == [1]  # now "repeat" is furthest over (1 > 0)
    policy.on_store_miss(keys(1))
    assert policy.target_t1_size == 0  # at least 0
    fill(policy, 0)  # remembered: back into "repeat", and no longer a ghost
    assert list(policy._t2) == keys(0) and not policy._b1


def test_arc_s_evicts_from_the_list_furthest_over_its_target_then_from_the_other():
    policy = make_cache_policy("arc-s", 8)
    fill(policy, 0, 1, 2)
    fill(policy, 3, 4)
    finish_request(policy, 3, 4)
    finish_request(policy, 3, 4)  # "once" = [0, 1, 2], "repeat" = [4, 3]
    policy.target_t1_size = 6  # "once" is 3 under its target; "repeat" 1 under its 2
    assert policy.coldest(5) == keys(4, 3, 0, 1, 2)
    block = policy.get(key(4))
    block.ref_cnt = 1  # busy: never a victim
    assert evicted_ids(policy.evict(3, protected={key(0)})) == [3, 1, 2]
    assert list(policy._b2) == keys(3) and list(policy._b1) == keys(1, 2)


def test_arc_s_ghost_lists_hold_half_the_capacity():
    policy = make_cache_policy("arc-s", 4)
    for i in range(50):
        fill(policy, i)
        if len(policy) == 4:
            policy.evict(1, protected=())
    assert len(policy._b1) == 2 and not policy._b2
