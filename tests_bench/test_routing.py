"""The fleet benchmark's routings (`tiering.benchmarks.serve.routing`): round-robin, by
conversation, and by the prefix each replica's KV events say it holds."""

from dataclasses import dataclass, field

import pytest

from tiering.benchmarks.serve.routing import PrefixIndex, Routing

BLOCK = 4


@dataclass
class BlockStored:  # vLLM's event types are told apart by their class names
    block_hashes: list
    parent_block_hash: object
    token_ids: list
    block_size: int
    medium: str | None = None
    locality: str | None = None


@dataclass
class BlockRemoved:
    block_hashes: list
    medium: str | None = None
    locality: str | None = None


@dataclass
class AllBlocksCleared:
    extra: list = field(default_factory=list)


TOKENS = list(range(16))  # 4 blocks


def stored(first: int, count: int, medium=None, locality=None, tokens=True) -> BlockStored:
    """Blocks `first` .. of `TOKENS`, hashed as ``h<i>``; without `tokens`, a placeholder."""
    hashes = [f"h{i}" for i in range(first, first + count)]
    parent = f"h{first - 1}" if first else None
    ids = TOKENS[first * BLOCK : (first + count) * BLOCK] if tokens else []
    return BlockStored(hashes, parent, ids, BLOCK if tokens else 0, medium, locality)


def test_the_index_scores_the_leading_blocks_each_replica_holds_by_where_it_holds_them():
    index = PrefixIndex(3, BLOCK)
    index.apply(0, [stored(0, 4)])  # vLLM's cache: the chain is learned from its tokens
    index.apply(1, [stored(0, 2, "CPU", "LOCAL", tokens=False)])  # a placeholder: the hashes only
    index.apply(2, [stored(0, 1, "STORAGE", "REMOTE", tokens=False), stored(2, 1, "STORAGE", "LOCAL", tokens=False)])
    assert index.scores(TOKENS) == pytest.approx([4.0, 1.6, 0.4])  # replica 2 lacks block 1: its prefix ends
    assert index.scores([99, *TOKENS[1:]]) == [0.0, 0.0, 0.0]  # another first block: nobody's prefix
    index.apply(0, [BlockRemoved(["h1"], None), stored(1, 1, "CPU", "LOCAL", tokens=False)])
    assert index.scores(TOKENS)[0] == pytest.approx(1.0 + 0.8 + 2.0)  # block 1 now only in its CPU tier
    index.apply(0, [AllBlocksCleared()])  # vLLM's cache reset: the GPU's blocks go, the CPU tier's stay
    assert index.scores(TOKENS)[0] == 0.0
    index.apply(0, [stored(0, 1)])
    assert index.scores(TOKENS)[0] == pytest.approx(1.0 + 0.8)


class Scores:
    def __init__(self, scores):
        self.values = scores

    def scores(self, tokens, shared_credit=False):
        return self.values


def test_round_robin_deals_requests_in_turn_and_sessions_keep_a_conversation_on_one_replica():
    rr = Routing("round-robin", 2, [0, 0, 1, 1])
    assert [rr.choose(i, TOKENS) for i in range(4)] == [0, 1, 0, 1]
    session = Routing("session", 2, [0, 1, 0, 2, 1, 2])
    assert [session.choose(i, TOKENS) for i in range(6)] == [0, 1, 0, 0, 1, 0]


def test_kv_events_routing_takes_the_longest_prefix_then_the_replica_less_busy_then_less_sent():
    index = Scores([1.0, 3.0, 3.0])
    routing = Routing("kv-events", 3, [], index)
    routing.started(1)
    assert routing.choose(0, TOKENS) == 2  # as long a prefix as 1, and idle
    routing.finished(1)
    index.values = [0.0, 0.0, 0.0]
    assert [routing.choose(i, TOKENS) for i in range(1, 3)] == [0, 1]  # the ones sent fewer
    with pytest.raises(ValueError, match="kv-events and kv-shared with an index"):
        Routing("kv-events", 2, [])


def test_router_weights_are_settable_by_place_and_bad_ones_refused():
    from tiering.benchmarks.serve.routing import weights_arg

    weights = weights_arg("storage/remote=0.1, CPU=0.5")
    assert weights == {"STORAGE/REMOTE": 0.1, "CPU": 0.5}
    index = PrefixIndex(1, BLOCK, weights)
    index.apply(0, [stored(0, 1), stored(0, 1, "CPU", "LOCAL", tokens=False)])
    index.apply(0, [BlockRemoved(["h0"], None)])  # vLLM's cache let it go: the CPU tier's weight
    assert index.scores(TOKENS) == [0.5]
    for bad in ("DISK=1", "CPU=-1", "CPU=x", "CPU"):
        with pytest.raises(ValueError, match="expected PLACE=WEIGHT"):
            weights_arg(bad)


def test_replicas_out_of_service_get_nothing_and_their_conversations_move():
    rr = Routing("round-robin", 3, [])
    rr.leave(2)
    assert [rr.choose(i, TOKENS) for i in range(4)] == [0, 1, 0, 1]
    rr.join(2)
    assert rr.choose(5, TOKENS) == 2
    session = Routing("session", 2, [0, 1, 0, 1, 1])
    assert [session.choose(i, TOKENS) for i in range(2)] == [0, 1]
    session.leave(1)
    assert [session.choose(i, TOKENS) for i in range(2, 4)] == [0, 0]  # conversation 1 moved to 0
    session.join(1)
    assert session.choose(4, TOKENS) == 0  # and stays there
    kv = Routing("kv-events", 2, [], Scores([0.0, 5.0]))
    kv.leave(1)
    assert kv.choose(0, TOKENS) == 0  # the longest prefix is on a replica out of service
    kv.leave(0)
    with pytest.raises(RuntimeError, match="no replica in service"):
        kv.choose(1, TOKENS)


def test_shared_credit_counts_a_shared_tiers_blocks_for_every_replica_and_load_spreads_a_burst():
    index = PrefixIndex(2, BLOCK, shared_places=frozenset({"STORAGE/REMOTE"}))
    index.apply(0, [stored(0, 4), stored(0, 3, "STORAGE", "REMOTE", tokens=False)])
    assert index.scores(TOKENS) == pytest.approx([4.0, 0.0])  # kv-events: replica 1 holds nothing
    assert index.scores(TOKENS, shared_credit=True) == pytest.approx([4.0, 3 * 0.4])  # one load away
    index.apply(0, [BlockRemoved(["h1"], "STORAGE", "REMOTE")])  # gone from the shared tier
    assert index.scores(TOKENS, shared_credit=True) == pytest.approx([4.0, 0.4])
    local = PrefixIndex(2, BLOCK)  # private tiers: nothing is shared
    local.apply(0, [stored(0, 4), stored(0, 3, "STORAGE", "LOCAL", tokens=False)])
    assert local.scores(TOKENS, shared_credit=True) == pytest.approx([4.0, 0.0])

    burst = Routing("kv-shared", 2, [], Scores([4.0, 1.2]), load_weight=1.0)
    chosen = []
    for i in range(4):  # every request in flight on its replica
        chosen.append(burst.choose(i, TOKENS))
        burst.started(chosen[-1])
    assert chosen == [0, 0, 0, 1]  # 4 - 3 in flight < 1.2: the burst spills to the shared tier's reader
    kv = Routing("kv-events", 2, [], Scores([4.0, 1.2]), load_weight=1.0)
    for i in range(4):
        kv.started(kv.choose(i, TOKENS))
    assert kv.in_flight == [4, 0]  # kv-events weighs no load


def test_a_scale_out_reports_the_joining_replicas_first_requests_and_a_kill_the_moved_turns():
    import asyncio

    from tiering.benchmarks.serve.scenarios import FIRST_REQUESTS, Scenario

    def outcome(index, arrival_s, replica):
        return {"index": index, "arrival_s": arrival_s, "replica": replica}

    scale = Scenario("scale-out", 10.0, 2)
    routing = Routing("round-robin", 2, [])
    ((at_s, join),) = scale.actions(routing, [])
    assert at_s == 10.0 and routing.down == {1}
    asyncio.run(join())
    assert routing.down == set()
    outcomes = [outcome(i, 10.0 + i, i % 2) for i in range(2 * FIRST_REQUESTS + 4)]
    assert scale.apart(outcomes, []) == list(range(1, 2 * FIRST_REQUESTS, 2))
    assert "joins at 10 s" in scale.describe()

    kill = Scenario("kill-replica", 5.0, 2)
    conversation_of = [0, 1, 2, 0, 1, 2, 1]
    replicas = [0, 1, 1, 0, 0, 0, 0]
    outcomes = [outcome(i, float(i * 2), replicas[i]) for i in range(7)]  # the kill at 5 s: after request 2
    assert kill.apart(outcomes, conversation_of) == [4, 5]  # conversations 1 and 2's first turns after it
    with pytest.raises(ValueError, match="2 replicas or more"):
        Scenario("kill-replica", 5.0, 1)


def test_the_scenarios_requests_are_summarized_apart():
    from tiering.benchmarks.serve.report import summarize

    def outcome(index, prompt, cached, promoted, error=None):
        ttft = None if error else 0.1 * (index + 1)
        return {
            "index": index,
            "arrival_s": 0.0,
            "replica": 0,
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "ttft_s": ttft,
            "output_tokens": 1,
            "error": error,
            "engine": None,
            "promoted_blocks": promoted,
        }

    outcomes = [outcome(0, 64, 0, 0), outcome(1, 96, 32, 1), outcome(2, 96, 64, 2), outcome(3, 64, 0, 0, "gone")]
    counters = {"prompt_tokens": 256, "computed_tokens": 160, "cached_tokens_by_source": {}, "load_bytes": 0}
    run = {"outcomes": outcomes, "wall_s": 1.0, "vllm": counters, "apart": [1, 2, 3]}
    apart = summarize(run, [0, 64, 64, 0], block_tokens=32)["apart"]
    assert apart["requests"] == 3 and apart["failed"] == 1
    assert (apart["prompt_tokens"], apart["computed_tokens"]) == (192, 96)
    assert (apart["prefix_tokens"], apart["prefix_computed_tokens"], apart["promoted_tokens"]) == (128, 32, 96)
    assert apart["ttft_s"]["p50"] == pytest.approx(0.25)


def test_a_rolling_restart_drains_restarts_and_rejoins_each_replica_in_turn():
    import asyncio

    from tiering.benchmarks.serve.scenarios import Scenario

    seen = []

    class Server:
        def __init__(self, name):
            self.name = name

        def restart(self):
            seen.append((self.name, sorted(routing.down), list(routing.in_flight)))
            return Server(self.name + "'")

    rolling = Scenario("rolling-restart", 3.0, 2)
    routing = Routing("round-robin", 2, [])
    servers = [Server("0"), Server("1")]
    ((at_s, roll),) = rolling.actions(routing, servers)
    assert at_s == 3.0
    routing.started(0)  # a request in flight on replica 0: the restart waits for it

    async def run():
        task = asyncio.create_task(roll())
        await asyncio.sleep(0.1)
        assert seen == [] and routing.down == {0}  # out of the router, draining
        routing.finished(0)
        await task

    asyncio.run(run())
    assert seen == [("0", [0], [0, 0]), ("1", [1], [0, 0])]  # one at a time, the other serving
    assert [s.name for s in servers] == ["0'", "1'"] and routing.down == set()
    back_s = rolling.marks["back_s"]
    assert back_s >= 3.1
    outcomes = [{"index": i, "arrival_s": t, "replica": 0} for i, t in enumerate([1.0, 3.0, 3.05, back_s + 1])]
    assert rolling.apart(outcomes, []) == [1, 2]
