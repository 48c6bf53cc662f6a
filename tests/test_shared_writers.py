"""Engines that write one shared tier at once (replicas of a fleet): the same keys stored by
both at the same time are never torn nor corrupted, every byte either loads is the block's,
each engine's accounting matches what the store holds, and a block one engine finds that
another stored is counted apart (``found_blocks_loaded``)."""

import threading

import pytest

from tests.helpers import block_bytes, keys

BLOCKS = 48


def shared_configs(tmp_path, valkey_cluster, key_prefix) -> dict[str, dict]:
    return {
        "file": {"type": "file", "root_dir": str(tmp_path / "kv"), "shared": True, "probe_misses": True},
        "valkey": {
            "type": "valkey",
            "addresses": valkey_cluster.addresses,
            "cluster_mode": True,
            "key_prefix": key_prefix,
        },
    }


def counters(engine) -> dict:
    (tier,) = engine.manager.get_stats()["tiers"].values()
    return tier


@pytest.mark.parametrize("kind", ["file", "valkey"])
def test_two_engines_storing_the_same_blocks_at_once_load_only_whole_right_bytes(
    kind, tmp_path, valkey_cluster, key_prefix, engine_factory
):
    config = shared_configs(tmp_path, valkey_cluster, key_prefix)[kind]
    first, second = engine_factory(config, num_blocks=8), engine_factory(config, num_blocks=8)
    start = threading.Barrier(2)
    errors: list[BaseException] = []

    def store_all(engine, order) -> None:
        try:
            start.wait(10)
            for i in range(0, BLOCKS, 4):
                engine.store(*order[i : i + 4])
        except BaseException as exc:  # the test fails on it below
            errors.append(exc)

    ids = list(range(BLOCKS))
    writers = [
        threading.Thread(target=store_all, args=(first, ids)),
        threading.Thread(target=store_all, args=(second, ids[::-1])),  # the same keys, met half way
    ]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(60)
    assert not errors, errors

    for engine in (first, second):
        engine.store(*range(1000, 1008))  # its CPU tier forgets them: loads come from the shared tier
        for i in range(0, BLOCKS, 4):
            chunk = list(range(i, i + 4))
            assert engine.lookup_until_done(*chunk) == [True] * 4
            assert engine.loaded_bytes(*chunk) == [block_bytes(key, len(engine.rows[0])) for key in keys(*chunk)]
        tier = counters(engine)
        assert tier["counters"]["failures"].get("load_corrupt", 0) == 0
        assert abs(tier["gauges"]["blocks"] - (BLOCKS + 8)) <= 1  # what the store holds of its own

    # what the store holds: a third engine over it finds every block, whole
    third = engine_factory(config, num_blocks=8)
    assert third.lookup_until_done(*range(4)) == [True] * 4
    assert third.loaded_bytes(*range(4)) == [block_bytes(key, len(third.rows[0])) for key in keys(*range(4))]
    assert counters(third)["counters"]["found_blocks_loaded"] == 4


def test_a_block_another_engine_stored_is_counted_apart_when_loaded(tmp_path, engine_factory):
    config = {"type": "file", "root_dir": str(tmp_path / "kv"), "shared": True, "probe_misses": True}
    writer, reader = engine_factory(config, num_blocks=4), engine_factory(config, num_blocks=4)
    writer.store(0, 1)
    writer.store(2, 3, 4, 5)  # 0 and 1 now only in the shared directory
    assert writer.lookup_until_done(0, 1) == [True, True]
    assert reader.lookup_until_done(0, 1) == [True, True]  # found by a probe: the writer's
    assert counters(writer)["counters"]["found_blocks_loaded"] == 0
    assert counters(reader)["counters"]["found_blocks_loaded"] == 2
    assert counters(reader)["counters"]["blocks_loaded"] == 2


def test_a_shared_directory_refuses_segments(tmp_path):
    from tiering.tiers.factory import TierConfigError, block_store_parts

    with pytest.raises(TierConfigError, match="segments are one engine's"):
        block_store_parts({"type": "file", "root_dir": str(tmp_path), "shared": True, "layout": "segments"})
