"""`tiering-bench serve --replicas 2 --shared-tier file` on a handful of conversations: both
replicas start, each on its own core where there are two; under round-robin every second turn
reaches the replica that did not serve the first, which loads the first one's blocks from the
shared directory; under kv-events routing it follows its prefix instead; the report adds up."""

import json
import os
import re
import shlex
from pathlib import Path

import pytest

from tiering.benchmarks.loadgen import main

pytestmark = pytest.mark.timeout(900)


def fleet_argv(tmp_path: Path, shared_tier: str) -> list[str]:
    """`tiering-bench serve` of two replicas sharing a tier of `shared_tier` over 3
    conversations of 8 ids (256 tokens), then each again with 2 more ids, 1.5 s apart:
    round-robin sends each second turn to the other replica (requests 0,1,2 to 0,1,0; 3,4,5
    to 1,0,1), after its cascades landed."""
    trace = tmp_path / "trace.jsonl"
    firsts = [[1000 * c + i for i in range(8)] for c in range(3)]
    turns = firsts + [[*ids, 1000 * c + 100, 1000 * c + 101] for c, ids in enumerate(firsts)]
    lines = [
        {"timestamp": 1500 * n, "input_length": 32 * len(ids), "output_length": 4, "hash_ids": ids}
        for n, ids in enumerate(turns)
    ]
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    argv = ["serve", "--trace", str(trace), "--model-shape", "tiny", "--time-scale", "1", "--max-concurrency", "1"]
    argv += ["--max-model-len", "512", "--gpu-blocks", "24", "--cpu-bytes", "256KiB", "--work-dir", str(tmp_path / "w")]
    return [*argv, "--replicas", "2", "--shared-tier", shared_tier, "--configurations", "shared"]


def test_two_replicas_share_a_mooncake_pool_of_their_own_segments(tmp_path):
    from tiering.testing.mooncake_pool import unavailable

    if unavailable():
        pytest.skip(f"no Mooncake pool here: {unavailable()}")
    output = tmp_path / "fleet.json"
    assert main([*fleet_argv(tmp_path, "mooncake"), "--routing", "round-robin", "--output", str(output)]) == 0
    summary = json.loads(output.read_text())["configurations"]["shared/round-robin"]["summary"]
    assert summary["failed"] == 0 and summary["requests"] == 6
    assert summary["found_tokens"] >= 2 * 256  # second turns loaded the other replica's blocks from the pool


def test_two_replicas_share_a_file_tier_and_route_by_round_robin_or_kv_events(tmp_path):
    output = tmp_path / "fleet.json"
    argv = fleet_argv(tmp_path, "file")
    assert main([*argv, "--routing", "round-robin,kv-events", "--output", str(output)]) == 0

    report = json.loads(output.read_text())
    runs = report["configurations"]
    assert list(runs) == ["shared/round-robin", "shared/kv-events"]
    for name, run in runs.items():
        summary = run["summary"]
        assert summary["failed"] == 0 and summary["requests"] == 6, (name, run["outcomes"])
        replicas = summary["replicas"]
        assert [r["requests"] for r in replicas] == [3, 3] or name.endswith("kv-events")
        for part in [summary, *replicas]:  # one more request of 2 tokens per replica settles its counters
            served = sum(part["cached_tokens_by_source"].values())
            assert part["computed_tokens"] + served == part["prompt_tokens"], name
        if len(os.sched_getaffinity(0)) >= 2:
            assert [r["cpus"] for r in replicas] == [
                [min(os.sched_getaffinity(0))],
                [sorted(os.sched_getaffinity(0))[1]],
            ]

    rr = runs["shared/round-robin"]["summary"]
    assert rr["found_tokens"] >= 2 * 256  # second turns loaded the other replica's blocks from the directory
    kv = runs["shared/kv-events"]
    replica_of = [o["replica"] for o in sorted(kv["outcomes"], key=lambda o: o["index"])]
    assert replica_of[3:] == replica_of[:3]  # each second turn went where its prefix was
    assert kv["summary"]["found_tokens"] == 0


def test_the_smallest_fleet_command_in_the_docs_shows_another_replicas_blocks(tmp_path):
    """A new user's fleet of 16 requests showed no shared-tier hit: docs/vllm.md prints the
    smallest command that does, and this runs it as printed (its output and servers' work
    directory moved into the test's own)."""
    page = (Path(__file__).resolve().parent.parent / "docs" / "vllm.md").read_text()
    (command,) = [b for b in re.findall(r"```sh\n(.*?)\n```", page, flags=re.S) if "--max-requests 16" in b]
    argv = shlex.split(command.replace("\\\n", " "))
    assert argv[:2] == [".venv-vllm/bin/tiering-bench", "serve"]
    output = tmp_path / "fleet.json"
    argv = [str(output) if word == "fleet.json" else word for word in argv[1:]]
    assert main([*argv, "--work-dir", str(tmp_path / "w"), "--quiet"]) == 0
    summary = json.loads(output.read_text())["configurations"]["shared/round-robin"]["summary"]
    assert summary["failed"] == 0 and summary["found_tokens"] > 0, summary


def scenario_runs(tmp_path: Path, *moment: str) -> dict:
    """The fleet of `fleet_argv`, private and shared directories, round-robin, with `moment`."""
    output = tmp_path / "fleet.json"
    argv = [*fleet_argv(tmp_path, "file"), "--routing", "round-robin", "--output", str(output), *moment]
    argv[argv.index("--configurations") + 1] = "private,shared"
    assert main(argv) == 0
    return json.loads(output.read_text())["configurations"]


def test_a_replica_that_joins_loads_what_the_fleet_stored_from_the_shared_tier(tmp_path):
    """Requests 0-2 (at 0, 1.5, 3 s) find replica 1 out of service; it joins at 4 s and takes
    requests 3 and 5 (second turns of conversations 0 and 2), whose prefixes replica 0 stored:
    from the shared directory it computes none of them, with private tiers all of them."""
    runs = scenario_runs(tmp_path, "--scale-out-at", "4")
    for name, run in runs.items():
        assert [o["replica"] for o in sorted(run["outcomes"], key=lambda o: o["index"])] == [0, 0, 0, 1, 0, 1], name
        assert run["apart"] == [3, 5] and "joins at 4 s" in run["description"]
    private, shared = runs["private/round-robin"]["summary"]["apart"], runs["shared/round-robin"]["summary"]["apart"]
    assert private["failed"] == shared["failed"] == 0
    assert private["prefix_tokens"] == shared["prefix_tokens"] == 2 * 256
    assert private["prefix_computed_tokens"] == 2 * 256 and private["promoted_tokens"] == 0
    assert shared["prefix_computed_tokens"] == 0 and shared["promoted_tokens"] >= 2 * 256
    assert runs["shared/round-robin"]["summary"]["replicas"][1]["found_tokens"] >= 2 * 256


def test_a_killed_replicas_conversations_move_and_their_next_turn_loads_from_the_shared_tier(tmp_path):
    """Replica 1 serves request 1 (conversation 1) and is killed at 4 s; conversation 1's next
    turn (request 4, at 6 s) goes to replica 0, which loads its prefix from the shared
    directory, and recomputes it with private tiers. Nothing of the killed server is left."""
    runs = scenario_runs(tmp_path, "--kill-replica-at", "4")
    for name, run in runs.items():
        assert [o["replica"] for o in sorted(run["outcomes"], key=lambda o: o["index"])] == [0, 1, 0, 0, 0, 0], name
        assert run["apart"] == [4] and run["summary"]["failed"] == 0, name
    private, shared = runs["private/round-robin"]["summary"]["apart"], runs["shared/round-robin"]["summary"]["apart"]
    assert private["prefix_computed_tokens"] == private["prefix_tokens"] == 256
    assert shared["prefix_computed_tokens"] == 0 and shared["promoted_tokens"] >= 256


def test_a_rolling_restart_routes_around_each_replica_and_no_request_fails(tmp_path):
    """From 2 s, replica 0 then replica 1 are drained, stopped (SIGTERM) and started again on
    their ports; the requests meanwhile go to the one serving, none fails, and every request
    after the restarts finds its prefix (the restarted replicas' tiers, or the shared one)."""
    output = tmp_path / "fleet.json"
    argv = [*fleet_argv(tmp_path, "file"), "--routing", "session", "--output", str(output)]
    assert main([*argv, "--rolling-restart-at", "2"]) == 0
    run = json.loads(output.read_text())["configurations"]["shared/session"]
    assert run["summary"]["failed"] == 0, run["outcomes"]
    assert run["apart"] and run["apart"][0] == 2  # request 2 (at 3 s) arrived during the restarts
    seconds = [o for o in run["outcomes"] if o["index"] >= 3]
    assert all(o["cached_tokens"] >= 256 for o in seconds), seconds  # every second turn's prefix was kept
