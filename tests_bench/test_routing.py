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

    def scores(self, tokens):
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
    with pytest.raises(ValueError, match="kv-events with an index"):
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
