"""The load generator: trace reading, workloads, bounds, and runs of the real CLI."""

import contextlib
import errno
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tiering import ConfigError, RegionInUseError
from tiering.benchmarks.loadgen import cli, replay, runs
from tiering.benchmarks.loadgen.bounds import belady_hit_rate, prefix_hit_rate, unbounded_hit_rate
from tiering.benchmarks.loadgen.workload import CONTINUATION_TTL_S, Request, read_trace, synthetic, with_hints

TRACE = Path(__file__).parents[1] / "traces" / "conversation_trace.jsonl.gz"  # shipped: see traces/README.md
REAL_LINES = """\
{"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]}
{"timestamp": 0, "input_length": 7322, "output_length": 490, "hash_ids": [0, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27]}
{"timestamp": 0, "input_length": 2290, "output_length": 316, "hash_ids": [0, 42, 43, 44, 45]}
"""


def test_trace_reader_on_real_lines(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text(REAL_LINES)
    first, second, third = read_trace(path)
    assert (first.timestamp_ms, first.input_length, first.output_length) == (0, 6758, 500)
    assert first.hash_ids == tuple(range(14))
    assert first.block_tokens() == [512] * 13 + [6758 - 13 * 512]
    assert second.hash_ids[0] == 0 and third.block_tokens() == [512] * 4 + [242]
    assert len(read_trace(path, max_requests=2)) == 2


def test_a_bad_trace_line_is_named(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text(REAL_LINES + '{"timestamp": 5}\n')
    with pytest.raises(ValueError, match=r"trace\.jsonl:4: not a trace record"):
        read_trace(path)


@pytest.mark.parametrize("name", ["multi-turn", "long-doc", "zipf", "shared-prefix", "hot-prefix"])
def test_synthetic_workloads_are_deterministic_and_reuse_prefixes(name):
    requests = synthetic(name, 200, seed=1)
    assert requests == synthetic(name, 200, seed=1) and requests != synthetic(name, 200, seed=2)
    assert len(requests) == 200 and all(r.input_length <= 512 * len(r.hash_ids) for r in requests)
    assert 0.2 < unbounded_hit_rate(requests) < 1.0
    with pytest.raises(ValueError, match="unknown workload 'chat'"):
        synthetic("chat", 1)


def test_the_hot_prefix_workload_sends_conversations_on_one_system_prompt_in_bursts():
    from tiering.benchmarks.loadgen.workload import HOT_BURST, HOT_PAUSE_MS, HOT_SYSTEM_BLOCKS

    warm, *requests = synthetic("hot-prefix", 3 * HOT_BURST + 1)
    system = warm.hash_ids[:HOT_SYSTEM_BLOCKS]
    assert all(r.hash_ids[:HOT_SYSTEM_BLOCKS] == system for r in requests)
    firsts, seconds = requests[:HOT_BURST], requests[HOT_BURST : 2 * HOT_BURST]
    assert warm.timestamp_ms == 0 and firsts[0].timestamp_ms == HOT_PAUSE_MS / 2  # the prompt cached, then bursts
    assert firsts[-1].timestamp_ms - firsts[0].timestamp_ms < 1000  # a burst, a pause, a burst
    assert seconds[0].timestamp_ms - firsts[0].timestamp_ms == HOT_PAUSE_MS
    assert [s.hash_ids[:-1] for s in seconds] == [f.hash_ids for f in firsts]  # each one's second turn
    assert len({f.hash_ids for f in firsts}) == HOT_BURST
    assert requests[2 * HOT_BURST].hash_ids[:HOT_SYSTEM_BLOCKS] == system


def blocks(*ids):
    return [Request(0, 512, 1, (block,)) for block in ids]


def test_bounds_on_hand_checked_sequences():
    a, b, c, d = 1, 2, 3, 4
    # ABCABC: every second reference hits with no limit; Belady with 2 blocks keeps A and B
    # and never caches C (needed last): A and B hit once each.
    assert unbounded_hit_rate(blocks(a, b, c, a, b, c)) == pytest.approx(3 / 6)
    assert belady_hit_rate(blocks(a, b, c, a, b, c), 2) == pytest.approx(2 / 6)
    # ABCDABCD with 3 blocks: A, B, C cached, D never (its next use is last), so A, B, C hit.
    assert belady_hit_rate(blocks(a, b, c, d, a, b, c, d), 3) == pytest.approx(3 / 8)
    # ABACAB with 1 block: A is kept (needed at 2, then 4); B and C bypass it.
    assert belady_hit_rate(blocks(a, b, a, c, a, b), 1) == pytest.approx(2 / 6)
    assert belady_hit_rate(blocks(a, a), 0) == 0.0
    # A partial last block counts its own tokens: 700 tokens = 512 + 188.
    assert unbounded_hit_rate([Request(0, 700, 1, (a, b)), Request(0, 700, 1, (a, c))]) == pytest.approx(512 / 1400)
    # It is never cached, as under vLLM, even when a later request shows its id again.
    partial_then_full = [Request(0, 700, 1, (a, b)), Request(0, 1024, 1, (a, b)), Request(0, 1024, 1, (a, b))]
    expected = (512 + 512 + 512) / (700 + 1024 + 1024)  # a twice, b only once stored in full
    for bound in (unbounded_hit_rate, prefix_hit_rate, lambda requests: belady_hit_rate(requests, 2)):
        assert bound(partial_then_full) == pytest.approx(expected)


def test_the_replay_never_looks_up_or_stores_a_partial_last_block(tmp_path):
    trace = tmp_path / "trace.jsonl"
    lines = [(700, [1, 2]), (1024, [1, 2]), (1024, [1, 2])]  # block 2 partial, then full
    trace.write_text(
        "".join(
            f'{{"timestamp": {i}, "input_length": {n}, "output_length": 1, "hash_ids": {ids}}}\n'
            for i, (n, ids) in enumerate(lines)
        )
    )
    output = tmp_path / "run.json"
    argv = ["--trace", str(trace), "--gpu-cache-blocks", "0", "--config", str(tmp_path / "engine.yaml")]
    (tmp_path / "engine.yaml").write_text("cpu_bytes_to_use: 1MiB\n")
    assert cli.main([*argv, "--output", str(output)]) == 0
    report = json.loads(output.read_text())
    assert report["hit_rate"]["cpu"] == pytest.approx((512 + 512 + 512) / (700 + 1024 + 1024))
    assert report["transfers"]["gpu_to_cpu"]["bytes"] == 2 * 64 * 1024  # block 1, and block 2 once full


def test_the_default_run_verifies_every_byte_and_writes_its_report(tmp_path, capsys):
    output, picture = tmp_path / "run.json", tmp_path / "run.png"
    assert cli.main(["--verify", "--max-requests", "80", "--output", str(output), "--plot", str(picture)]) == 0
    report = json.loads(output.read_text())
    assert report["requests"] == 80 and report["verify_failures"] == 0 and report["failed_jobs"] == 0
    assert set(report["hit_rate"]) == {"gpu", "cpu", "file", "total"}
    assert 0 < report["hit_rate"]["total"] <= report["unbounded_hit_rate"] + 1e-9
    assert 0 < report["belady_hit_rate"] <= report["unbounded_hit_rate"]
    blocks = report["tiers"]["file"]["stats"]["gauges"]["capacity_bytes"] // (64 * 1024 + 4096)
    assert report["belady_all_tiers_capacity_blocks"] == 64 + report["belady_capacity_blocks"] + blocks
    assert report["hit_rate"]["total"] <= report["belady_all_tiers_hit_rate"] + 1e-9
    assert report["tiers"]["file"]["store_bytes"] > 0
    assert report["transfers"]["gpu_to_cpu"]["bytes"] > 0
    assert {"p50", "p99"} <= set(report["latency_us"]["lookup"])
    assert report["inputs"]["config"]["secondary_tiers"][0]["type"] == "file"
    assert picture.stat().st_size > 0
    assert "hit rate (tokens)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--config", "/nonexistent/engine.yaml"], "engine.yaml: cannot read the file"),
        (["--block-bytes", "8kb"], "--block-bytes: read 8,000 bytes, not a multiple of 2,048"),
        (["--gpu-cache-blocks", "2"], "--gpu-cache-blocks 2 cannot hold the longest prompt"),
        (
            ["--model", "gpt-9"],
            "argument --model: invalid choice: 'gpt-9' (choose from 'gpt-oss-120b', 'gpt-oss-20b', 'llama-3.1-70b'",
        ),
    ],
)
def test_bad_input_is_one_clear_line_and_exit_status_2(argv, message, capsys):
    try:
        status = cli.main([*argv, "--max-requests", "5"])
    except SystemExit as exc:  # an option argparse refuses
        status = exc.code
    assert status == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.timeout(180)  # five short runs
def test_a_rerun_over_a_used_directory_never_exceeds_its_bound_and_leaves_no_files(tmp_path, capsys):
    config = tmp_path / "engine.yaml"
    root = tmp_path / "kv"
    config.write_text(f"cpu_bytes_to_use: 1MiB\nsecondary_tiers: [{{type: file, root_dir: {root}}}]\n")
    argv = ["--config", str(config), "--workload", "multi-turn", "--max-requests", "60"]
    for run in range(2):  # the second run finds the first one's directory
        output = tmp_path / f"run{run}.json"
        assert cli.main([*argv, "--output", str(output)]) == 0
        report = json.loads(output.read_text())
        assert report["schema_version"] == 8 and not report["inputs"]["warm_start"]
        assert report["hit_rate"]["total"] <= report["prefix_hit_rate"] + 1e-9  # (it may reach it exactly)
        assert report["prefix_hit_rate"] <= report["unbounded_hit_rate"]
        assert list(root.iterdir()) == []  # the run's namespace was removed
    assert cli.main([*argv, "--keep", "--output", str(tmp_path / "kept.json")]) == 0
    assert len(list(root.iterdir())) == 2  # the run's namespace and its identity's records
    assert "bound (not with --warm-start)" not in capsys.readouterr().out
    assert cli.main([*argv, "--warm-start", "--output", str(tmp_path / "w1.json")]) == 0
    assert cli.main([*argv, "--warm-start", "--output", str(tmp_path / "w2.json")]) == 0
    assert "bound (not with --warm-start): repeated prefixes" in capsys.readouterr().out
    first, second = (json.loads((tmp_path / f"w{i}.json").read_text()) for i in (1, 2))
    assert second["inputs"]["warm_start"] and second["hit_rate"]["file"] > first["hit_rate"]["file"]  # w1's blocks hit


@pytest.mark.timeout(120)
def test_a_run_removes_what_it_stored_in_s3_unless_kept(tmp_path, s3_server, s3_bucket):
    config = tmp_path / "engine.yaml"
    config.write_text(
        "cpu_bytes_to_use: 1MiB\n"
        f"secondary_tiers: [{{type: s3, bucket: {s3_bucket}, endpoint_url: '{s3_server.endpoint_url}'}}]\n"
    )
    client = s3_server.client()
    argv = ["--config", str(config), "--max-requests", "30", "--quiet"]
    assert cli.main([*argv, "--output", str(tmp_path / "run.json")]) == 0
    assert json.loads((tmp_path / "run.json").read_text())["tiers"]["s3"]["store_bytes"] > 0
    assert client.list_objects_v2(Bucket=s3_bucket).get("KeyCount") == 0
    assert cli.main([*argv, "--keep"]) == 0
    assert client.list_objects_v2(Bucket=s3_bucket)["KeyCount"] > 0


def test_without_a_gpu_prefix_cache_the_cpu_tier_sees_every_block(tmp_path):
    output = tmp_path / "run.json"
    assert cli.main(["--gpu-cache-blocks", "0", "--max-requests", "60", "--output", str(output)]) == 0
    report = json.loads(output.read_text())
    assert report["hit_rate"]["gpu"] == 0 and report["hit_rate"]["total"] > 0
    assert report["inputs"]["gpu_prefix_cache"] is False


def test_the_engines_own_token_counters_agree_with_the_replay(tmp_path):
    """What Prometheus shows (the engine's per-request counters) is what the bench measured."""
    requests = synthetic("multi-turn", 120, seed=3)
    trace = tmp_path / "trace.jsonl"  # whole blocks only: the engine counts a block's tokens as 512
    trace.write_text(
        "".join(
            json.dumps(
                {
                    "timestamp": r.timestamp_ms,
                    "input_length": 512 * len(r.hash_ids),
                    "output_length": 1,
                    "hash_ids": list(r.hash_ids),
                }
            )
            + "\n"
            for r in requests
        )
    )
    output = tmp_path / "run.json"
    assert cli.main(["--trace", str(trace), "--gpu-cache-blocks", "0", "--quiet", "--output", str(output)]) == 0
    report = json.loads(output.read_text())
    engine = report["engine"]
    assert engine["requested_tokens"] == sum(512 * len(r.hash_ids) for r in requests)  # no GPU cache: all asked
    assert engine["hit_tokens"]["file"] > 0 and engine["lookups_repeated"] > 0
    # Equal but for a race the two count differently on a loaded machine: a block that
    # answered True and was evicted by a promotion the same request queued before it was
    # loaded is a hit to the engine (it answered True) and a miss to the bench (recomputed).
    # CI saw 2 such blocks of 763 once; a counting bug moves whole requests.
    for source in ("cpu", "file"):
        bench_tokens = report["hit_rate"][source] * engine["requested_tokens"]
        assert engine["hit_tokens"][source] == pytest.approx(bench_tokens, rel=0.01)
    assert engine["hit_rate"] == pytest.approx(report["hit_rate"]["total"])


def test_a_bad_config_file_names_the_key(tmp_path, capsys):
    config = tmp_path / "engine.yaml"
    config.write_text("cpu_bytes_to_use: 4MiB\nsecondary_tiers:\n  - type: file\n")
    assert cli.main(["--config", str(config), "--max-requests", "5"]) == 2
    assert "secondary_tiers[0].root_dir: required key is missing" in capsys.readouterr().err
    config.write_text("cpu_bytes_to_use: 4MiB\nx: a\x00b\n")  # a NUL byte: a bad file, not an engine failure
    assert cli.main(["--config", str(config), "--max-requests", "5"]) == 2
    assert "engine.yaml: line 2, column 5: not valid YAML: character #x0000" in capsys.readouterr().err


def test_a_run_that_fails_to_start_leaves_no_directory_behind(tmp_path, capsys):
    config, root = tmp_path / "engine.yaml", tmp_path / "new" / "kv"
    unreachable = "{type: valkey, addresses: ['127.0.0.1:1'], open_timeout_s: 1}"  # fails once the file tier opened
    config.write_text(
        f"cpu_bytes_to_use: 4MiB\nsecondary_tiers:\n  - {{type: file, root_dir: {root}}}\n  - {unreachable}\n"
    )
    assert cli.main(["--config", str(config), "--max-requests", "5"]) == 2
    assert "secondary_tiers[1]: tier valkey: " in capsys.readouterr().err
    assert not (tmp_path / "new").exists()  # the first tier's fresh namespace, and the directories above it


def test_replay_of_the_first_2000_requests_of_the_conversation_trace(tmp_path):
    config = tmp_path / "engine.yaml"
    config.write_text(
        f"cpu_bytes_to_use: 2MiB\nsecondary_tiers:\n  - type: file\n    root_dir: {tmp_path}\n    capacity_bytes: 32MiB\n"
    )
    output = tmp_path / "run.json"
    argv = ["--config", str(config), "--trace", str(TRACE), "--max-requests", "2000", "--block-bytes", "8KiB"]
    assert cli.main([*argv, "--verify", "--output", str(output)]) == 0
    report = json.loads(output.read_text())
    assert report["requests"] == 2000 and report["verify_failures"] == 0
    assert report["hit_rate"]["file"] > 0
    assert report["hit_rate"]["total"] <= report["unbounded_hit_rate"] + 1e-9


def test_gpu_blocks_are_never_leaked_when_a_cached_block_is_rewritten():
    from tiering import KVLayout, parse_config
    from tiering.benchmarks.loadgen.engine import SimulatedEngine

    engine = SimulatedEngine(parse_config("cpu_bytes_to_use: 64KiB"), KVLayout("t", 1, 4, 512), 4, "test-leak")
    try:
        a, b, c = b"a" * 12, b"b" * 12, b"c" * 12
        assert engine.allocate([a, b], keep=set()) is not None
        assert engine.gpu_prefix([c, b]) == 0  # b is cached but not a leading block
        assert engine.allocate([c, b], keep={c, b}) is not None  # b is recomputed in place of its old block
        assert len(engine._slots) + len(engine._free) == 4
        assert engine.allocate([b"d" * 12, b"e" * 12], keep={c, b}) is not None  # a's block and the spare
        assert engine.allocate([b"f" * 12], keep={c, b, b"d" * 12, b"e" * 12}) is None
    finally:
        engine.shutdown()


def test_a_request_offers_every_block_as_vllm_does_and_its_reuse_counts_when_it_finishes():
    from tiering import KVLayout, make_offload_key, parse_config
    from tiering.benchmarks.loadgen.engine import SimulatedEngine
    from tiering.benchmarks.loadgen.run import SchedulerLoop

    config = parse_config("cpu_bytes_to_use: 64KiB\neviction_policy: arc")
    engine = SimulatedEngine(config, KVLayout("t", 1, 4, 512), 3, "test-touch")
    try:
        loop = SchedulerLoop(engine)
        arc = engine.manager.primary_tier._order.policy("")
        key = [make_offload_key(i.to_bytes(8, "big"), 0) for i in range(3)]
        loop.run([Request(0, 1024, 1, (0, 1))])
        assert set(arc._t1) == {key[0], key[1]} and not arc._t2  # stored once: recency list
        loop.run([Request(1, 1536, 1, (0, 1, 2))])
        # 0 and 1 came from the GPU cache and were offered again: a reuse, frequency list
        assert set(arc._t2) == {key[0], key[1]} and set(arc._t1) == {key[2]}
    finally:
        engine.shutdown()


def wait_for_the_engine(pid: int, timeout_s: float = 60.0) -> Path:
    """Wait until tiering-bench process `pid` maps its engine's region; returns the region's
    path. (Its name is removed once the scheduler and the worker have mapped it, so the
    mapping is what shows the engine is up.)"""
    import time

    region, maps = Path("/dev/shm") / f"tiering-bench-{pid}.kv", Path(f"/proc/{pid}/maps")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if str(region) in maps.read_text():
                return region
        except OSError:
            pass
        time.sleep(0.05)
    raise AssertionError("the run never started its engine")


def test_a_terminated_run_shuts_down_and_leaves_no_shared_memory(tmp_path):
    import os
    import signal
    import subprocess
    import sys

    command = [sys.executable, "-m", "tiering.benchmarks.loadgen.cli", "--workload", "zipf", "--max-requests", "100000"]
    stderr = tmp_path / "stderr"
    with stderr.open("wb") as sink:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=sink)
    region = wait_for_the_engine(process.pid)
    os.kill(process.pid, signal.SIGTERM)
    assert process.wait(30) == 128 + signal.SIGTERM, stderr.read_text()[-3000:]
    assert not region.exists()


@pytest.mark.parametrize("error", [OSError(errno.EBADF, "cut in half"), RuntimeError("cut in half")], ids=repr)
def test_an_error_raised_by_the_stop_a_signal_asked_for_still_exits_with_the_signals_status(monkeypatch, capsys, error):
    """A SIGTERM that lands while the engine starts or stops cuts a step in half; what that
    step raises is printed, but the run was stopped by the signal (143), not by bad input (2):
    .ci/run saw a terminated run exit 2."""

    def interrupted(args, console, interrupts):
        try:
            interrupts(signal.SIGTERM, None)  # outside the replay: the handler raises
        except KeyboardInterrupt:
            raise error from None

    monkeypatch.setattr(cli, "run", interrupted)
    assert cli.main(["--max-requests", "5"]) == 128 + signal.SIGTERM
    assert "cut in half" in capsys.readouterr().err


def test_a_run_killed_outright_leaves_files_that_the_next_run_removes(tmp_path):
    config, root = tmp_path / "engine.yaml", tmp_path / "kv"
    config.write_text(f"cpu_bytes_to_use: 1MiB\nsecondary_tiers: [{{type: file, root_dir: {root}}}]\n")
    command = [sys.executable, "-m", "tiering.benchmarks.loadgen.cli", "--config", str(config), "--workload", "zipf"]
    process = subprocess.Popen(
        [*command, "--max-requests", "100000"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    wait_for_the_engine(process.pid)
    while not any(root.glob("*/*/*")):  # some blocks stored
        time.sleep(0.05)
    kept = subprocess.run([*command, "--max-requests", "20", "--keep"], capture_output=True, timeout=120)
    assert kept.returncode == 0  # a run beside it leaves the live run's files alone
    os.kill(process.pid, signal.SIGKILL)
    process.wait(30)
    left = {path.name for path in root.iterdir()}
    # each run: its namespace and its identity's records; the killed one's leases, and locks of its three
    assert len(left) == 8 and sum(name.endswith(runs.SUFFIX) for name in left) == 3
    assert subprocess.run([*command, "--max-requests", "20"], capture_output=True, timeout=120).returncode == 0
    remaining = list(root.iterdir())  # the killed run's namespaces and locks went; the kept ones stay
    assert len(remaining) == 2 and {path.name for path in remaining} <= left
    assert not any(path.name.endswith(runs.SUFFIX) for path in remaining) and any(root.glob("*/*/*"))


def test_the_scratch_directory_of_a_default_run_killed_outright_is_swept_by_the_next(tmp_path):
    environment = {**os.environ, "TMPDIR": str(tmp_path)}  # the default's file tier goes under the temp dir
    command = [sys.executable, "-m", "tiering.benchmarks.loadgen.cli", "--workload", "zipf", "--quiet"]
    process = subprocess.Popen(
        [*command, "--max-requests", "100000"], env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    wait_for_the_engine(process.pid)
    while not any(tmp_path.glob("tiering-bench-*/*/*/*")):  # some blocks stored
        time.sleep(0.05)
    os.kill(process.pid, signal.SIGKILL)
    process.wait(30)
    (killed,) = (path for path in tmp_path.iterdir() if path.is_dir())
    assert (tmp_path / (killed.name + runs.SUFFIX)).exists()
    done = subprocess.run([*command, "--max-requests", "20"], env=environment, capture_output=True, timeout=120)
    assert done.returncode == 0 and list(tmp_path.iterdir()) == []  # the killed run's and its own, both gone


def test_an_interrupt_inside_code_run_from_source_text_keeps_the_exit_status(tmp_path):
    """The signal can land while an import defines a dataclass, whose methods CPython compiles
    from source text; a plain KeyboardInterrupt leaving that code made the process kill itself
    with SIGINT at exit, whatever status the run returned."""
    import subprocess
    import sys

    (tmp_path / "interrupted_run.py").write_text(
        "import os, signal, sys\n"
        "from tiering.benchmarks.loadgen.replay import Interrupts\n"
        "interrupts = Interrupts()\n"
        "signal.signal(signal.SIGTERM, interrupts)\n"
        "try:\n"
        "    exec('os.kill(os.getpid(), signal.SIGTERM)\\nwhile True: pass')\n"
        "except KeyboardInterrupt:\n"
        "    sys.exit(interrupts.exit_status())\n"
    )
    run = subprocess.run([sys.executable, "-m", "interrupted_run"], cwd=tmp_path, timeout=60)
    assert run.returncode == 143


def test_a_signal_during_a_held_step_lets_the_step_end_and_then_interrupts():
    """Removing the earlier run's outputs is one held step: a signal between the two removals
    once left the old plot behind."""
    interrupts = replay.Interrupts()
    previous = signal.signal(signal.SIGTERM, interrupts)
    done = []
    try:
        with pytest.raises(replay.Interrupted), interrupts.held():
            signal.raise_signal(signal.SIGTERM)  # to this thread: its handler has run when this returns
            done.append("the rest of the step")
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert done and interrupts.exit_status() == 143


def test_a_run_over_a_faulty_tier_loads_no_wrong_byte(tmp_path):
    config = tmp_path / "engine.yaml"
    config.write_text(
        "cpu_bytes_to_use: 1MiB\n"
        "secondary_tiers:\n"
        "  - type: faulty\n"
        f"    inner: {{type: file, root_dir: {tmp_path}}}\n"
        "    failure_rate: 0.1\n"
        "    corruption_rate: 0.01\n"
        "    seed: 7\n"
    )
    output = tmp_path / "run.json"
    assert cli.main(["--config", str(config), "--max-requests", "300", "--verify", "--output", str(output)]) == 0
    report = json.loads(output.read_text())
    failures = report["tiers"]["faulty"]["failures"]
    assert report["verify_failures"] == 0
    assert failures.get("store", 0) + failures.get("load", 0) > 0  # faults were injected...
    assert report["hit_rate"]["faulty"] > 0  # ...and the tier still served hits
    # failed jobs are jobs, as the tier table counts them; failed calls (deletes, probes: no
    # job fails with them) apart, by kind: 2,504 failed deletes once read as failed jobs
    assert report["failed_calls"] == {reason: count for reason, count in failures.items() if count}
    assert report["failed_jobs"] >= report["tiers"]["faulty"]["stats"]["counters"]["jobs_failed"]


def test_two_tiers_of_one_type_are_reported_apart(tmp_path):
    config = tmp_path / "engine.yaml"
    config.write_text(
        "cpu_bytes_to_use: 1MiB\n"
        "secondary_tiers:\n"
        "  - {type: memory, capacity_bytes: 512KiB}\n"
        f"  - {{type: file, root_dir: {tmp_path / 'a'}, capacity_bytes: 1MiB}}\n"
        f"  - {{type: file, root_dir: {tmp_path / 'b'}, name: archive}}\n"
        "  - {type: memory}\n"
    )
    output = tmp_path / "run.json"
    assert cli.main(["--config", str(config), "--max-requests", "100", "--output", str(output)]) == 0
    report = json.loads(output.read_text())
    names = ["memory", "file", "archive", "memory-2"]
    assert list(report["tiers"]) == names and set(names) <= set(report["hit_rate"])
    assert report["tiers"]["memory-2"]["store_bytes"] > 0  # the second memory tier's numbers are its own


GOOD_LINE = '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}\n'
BAD_TRACES = [
    (
        '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [-1, 2]}\n',
        ":1: block id -1 is not an integer in 0 .. 2**64 - 1",
    ),
    (
        '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [18446744073709551616, 2]}\n',
        ":1: block id 18446744073709551616 is not",
    ),
    ('{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [true, 2]}\n', ":1: block id True is not"),
    (
        '{"timestamp": 0, "input_length": 6, "output_length": 5, "hash_ids": []}\n',
        ":1: hash_ids must be a non-empty list",
    ),
    (
        '{"timestamp": 0, "input_length": 6000, "output_length": 5, "hash_ids": [1]}\n',
        ":1: 6000 tokens do not fit 1 blocks of 512",
    ),
    ('{"timestamp": NaN, "input_length": 6, "output_length": 5, "hash_ids": [1]}\n', ":1: timestamp nan is not a time"),
    (GOOD_LINE + "[1, 2, 3]\n", ":2: a JSON list, not an object; expected JSON Lines"),
    (GOOD_LINE + '{"timestamp": 5}\n', ":2: not a trace record: input_length, output_length, hash_ids missing"),
    ("timestamp,input_length,output_length,hash_ids\n0,600,5,1;2\n", ":1: not JSON ('timestamp,input_length"),
    ("a,b\n", '"hash_ids": [block ids, 0 <= id < 2**64]}'),  # the whole format, no markup eaten
    ("", "no requests to replay"),
]


@pytest.mark.parametrize(("text", "message"), BAD_TRACES, ids=range(len(BAD_TRACES)))
def test_a_bad_trace_is_one_line_and_exit_status_2(tmp_path, capsys, text, message):
    trace = tmp_path / "trace.jsonl"
    trace.write_text(text)
    assert cli.main(["--trace", str(trace)]) == 2
    err = capsys.readouterr().err
    assert message in " ".join(err.split()) and "Traceback" not in err


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda path: path.write_bytes(b'{"timestamp": 0, \xff}\n'), "not UTF-8 text; expected JSON Lines"),
        (lambda path: path.mkdir(), "not a regular file"),
        (lambda path: os.mkfifo(path), "not a regular file"),  # reading it would block
        (lambda path: None, "No such file or directory"),
    ],
    ids=["non-utf8", "directory", "fifo", "missing"],
)
def test_an_unusable_trace_file_is_one_line_and_exit_status_2(tmp_path, capsys, make, message):
    trace = tmp_path / "trace.jsonl"
    make(trace)
    assert cli.main(["--trace", str(trace)]) == 2
    err = capsys.readouterr().err
    assert message in " ".join(err.split()) and "Traceback" not in err


def test_outputs_are_checked_before_the_run(tmp_path, capsys):
    for option in ("--output", "--plot"):
        assert cli.main(["--max-requests", "5", option, str(tmp_path / "missing" / "run.out")]) == 2
        captured = capsys.readouterr()
        assert f"{option} {tmp_path}/missing/run.out: the directory {tmp_path}/missing does not exist" in " ".join(
            captured.err.split()
        )
        assert captured.out == ""  # nothing was replayed


@pytest.mark.parametrize(
    "argv",
    [
        ["--time-scale", "nan"],
        ["--time-scale", "-1"],
        ["--max-requests", "0"],
        ["--gpu-blocks", "-3"],
        ["--metrics-port", "70000"],
        ["--block-bytes", "8EiB"],
        ["--seed", "-1"],
    ],
)
def test_bad_option_values_are_refused_by_the_parser(argv, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "argument --" in err and argv[0] in err  # the option is named


def test_help_documents_the_exit_statuses(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert "3  the engine failed while replaying" in out and "2  bad input" in out
    assert "tiering-bench overload ..." in out and "tiering-bench serve ..." in out


MARKUP = "[bold]x[/] [/] ^[a-zA-Z0-9._-]{1,255}$ [link=file:///etc]"  # rich markup, and a regex as botocore's


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (ConfigError("engine.yaml", [("secondary_tiers[0].bucket", MARKUP)]), 2),
        (ValueError(MARKUP), 2),
        (OSError(errno.EINVAL, MARKUP), 2),
        (TimeoutError(MARKUP), 2),
        (PermissionError(errno.EACCES, MARKUP), 2),
        (RegionInUseError(MARKUP), 2),
        (ImportError(MARKUP, name="aiobotocore"), 2),  # a tier's extra, not the bench's
        (replay.EngineFailure(MARKUP), 3),
        (RuntimeError(MARKUP), 3),
        (KeyError(MARKUP), 3),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, BaseException) else str(value),
)
def test_every_error_class_prints_whole_and_exits_with_its_documented_status(monkeypatch, capsys, error, status):
    """Never 1 (a wrong byte was loaded) for an error, whatever its message holds."""

    def failing(*args, **kwargs):
        raise error

    monkeypatch.setattr(cli, "run", failing)
    assert cli.main(["--max-requests", "5"]) == status
    err = " ".join(capsys.readouterr().err.split())
    assert MARKUP in err and "Traceback" not in err


def test_an_engine_failure_mid_replay_is_one_line_and_exit_status_3(monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise KeyError("prepare_load: key 00ff is not resident")

    monkeypatch.setattr(replay.SchedulerLoop, "run", broken)
    assert cli.main(["--max-requests", "5"]) == 3
    err = capsys.readouterr().err
    assert "engine failure: KeyError" in err and "Traceback" not in err


@pytest.mark.parametrize("missing", ["rich", "torch"])
def test_without_the_bench_extra_the_command_says_what_to_install(missing):
    code = (
        f"import sys; sys.modules[{missing!r}] = None; from tiering.benchmarks.loadgen import main; sys.exit(main([]))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == (
        f"tiering-bench needs the 'bench' extra ({missing} is not installed): pip install 'kv-tiering[bench]'"
    )


def test_every_field_of_the_json_is_documented(tmp_path):
    output = tmp_path / "run.json"
    assert cli.main(["--max-requests", "20", "--output", str(output)]) == 0
    report = json.loads(output.read_text())
    readme = (Path(__file__).resolve().parents[1] / "docs" / "load-generator.md").read_text()
    undocumented = [key for key in [*report, *report["inputs"]] if f"`{key}`" not in readme]
    assert undocumented == []


def test_the_summary_reads_whole_at_80_columns_in_a_pipe(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("COLUMNS", "80")
    config = tmp_path / "engine.yaml"  # the longest tier name there can be
    config.write_text(f"cpu_bytes_to_use: 1MiB\nsecondary_tiers: [{{type: memory, name: {'archive-' * 7}x}}]\n")
    assert cli.main(["--max-requests", "20", "--quiet", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80
    assert "…" not in out  # no header or value cut short
    assert "Secondary tiers" in out and "GPU<->CPU copies" in out
    run = out[: out.index("requests in")]  # the configuration comes first
    for fact in (
        "synthetic multi-turn workload, seed 0",
        "cpu tier ",
        "blocks (1 MiB), lru",
        "(memory), no capacity limit",
    ):
        assert fact in run, fact


def test_an_interrupted_replay_writes_its_partial_results_and_leaves_nothing_behind(tmp_path):
    import signal
    import subprocess
    import time

    output, plot = tmp_path / "run.json", tmp_path / "run.png"
    argv = ["--workload", "multi-turn", "--max-requests", "100000", "--output", str(output), "--plot", str(plot)]
    command = [sys.executable, "-m", "tiering.benchmarks.loadgen.cli", *argv]
    with subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) as bench:
        region = wait_for_the_engine(bench.pid)
        time.sleep(1)  # some requests replayed
        bench.send_signal(signal.SIGINT)
        _, err = bench.communicate(timeout=60)
    assert bench.returncode == 130
    report = json.loads(output.read_text())
    assert report["interrupted"] and 0 < report["requests"] < 100000 and plot.stat().st_size > 0
    assert report["hit_rate"]["total"] <= report["prefix_hit_rate"] + 1e-9  # (it may reach it exactly)
    assert "interrupted after" in err.decode()
    assert not region.exists()
    replayed = synthetic("multi-turn", 100000)[: report["requests"]]
    assert report["inputs"]["trace_span_s"] == (replayed[-1].timestamp_ms - replayed[0].timestamp_ms) / 1000


def test_a_tenant_share_keeps_the_replay_hit_rate_under_a_neighbours_flood(tmp_path):
    """The conversation trace as tenant 'replay', and a second tenant sending 10 prompts of
    blocks nobody else has per replayed request: without shares its CPU hit rate halves;
    with 90% of the tier as its share it stays within 10% of the rate it has alone."""
    tenants = {
        "alone": "",
        "flood without shares": "tenants: {}\n",
        "flood with shares": "tenants: {default_share: 0.1, quotas: {replay: 0.9}}\n",
    }
    rates = {}
    for name, section in tenants.items():
        config, output = tmp_path / f"{len(rates)}.yaml", tmp_path / f"{len(rates)}.json"
        config.write_text(f"cpu_bytes_to_use: 32MiB\n{section}")
        argv = ["--config", str(config), "--trace", str(TRACE), "--max-requests", "1000", "--block-bytes", "4KiB"]
        flood = [] if name == "alone" else ["--flood", "10"]
        assert cli.main([*argv, *flood, "--gpu-cache-blocks", "0", "--quiet", "--output", str(output)]) == 0
        report = json.loads(output.read_text())
        rates[name] = report["hit_rate"]["cpu"] if name == "alone" else report["hit_rate_by_tenant"]["replay"]["cpu"]
    assert rates["alone"] > 0.1
    assert rates["flood with shares"] >= 0.9 * rates["alone"]
    assert rates["flood without shares"] <= 0.6 * rates["alone"]


def test_a_signal_whose_exception_a_library_swallowed_still_stops_the_run(monkeypatch, tmp_path):
    """A SIGTERM that landed in an import while the run started raised in a bare ``except:``
    (1 start in 14 here): the run went on replaying 100,000 requests instead of exiting 143."""
    prepare = replay._prepare

    def swallowing(args, scratch):
        prepared = prepare(args, scratch)
        with contextlib.suppress(KeyboardInterrupt):  # as a library's bare except would
            signal.raise_signal(signal.SIGTERM)  # the run's handler raises
        return prepared

    monkeypatch.setattr(replay, "_prepare", swallowing)
    output = tmp_path / "run.json"
    assert cli.main(["--max-requests", "50", "--quiet", "--output", str(output)]) == 128 + signal.SIGTERM
    report = json.loads(output.read_text())
    assert report["interrupted"] and report["requests"] == 0 and report["hit_rate"]["total"] == 0


def test_a_run_stopped_before_its_first_request_writes_no_plot(monkeypatch, tmp_path):
    """A SIGTERM swallowed in an import stops the run before the replay: its report says so,
    but a plot of no request cannot, and looked like a whole run's (seen once in CI)."""
    prepare = replay._prepare

    def swallowing(args, scratch):
        prepared = prepare(args, scratch)
        with contextlib.suppress(KeyboardInterrupt):  # as a library's bare except would
            signal.raise_signal(signal.SIGTERM)
        return prepared

    monkeypatch.setattr(replay, "_prepare", swallowing)
    output, plot = tmp_path / "run.json", tmp_path / "run.png"
    plot.write_bytes(b"an earlier plot")
    argv = ["--max-requests", "50", "--quiet", "--output", str(output), "--plot", str(plot)]
    assert cli.main(argv) == 128 + signal.SIGTERM
    assert json.loads(output.read_text())["interrupted"] and not plot.exists()


@pytest.mark.timeout(300)  # a busy machine: a signal waits for the import of torch it lands in (30 s was short)
def test_a_run_stopped_while_starting_leaves_no_earlier_output_looking_like_its_own(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    output, plot = tmp_path / "run.json", tmp_path / "run.png"
    output.write_text('{"an earlier run": true}')
    plot.write_bytes(b"an earlier plot")
    command = [sys.executable, "-m", "tiering.benchmarks.loadgen.cli", "--output", str(output), "--plot", str(plot)]
    process = subprocess.Popen(
        [*command, "--max-requests", "100000"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 60
    while output.exists() and time.monotonic() < deadline:  # removed first, before torch is even imported
        time.sleep(0.01)
    os.kill(process.pid, signal.SIGTERM)
    assert process.wait(240) == 128 + signal.SIGTERM
    assert not plot.exists() and (not output.exists() or json.loads(output.read_text())["interrupted"])


def test_without_a_terminal_the_replay_logs_its_progress(monkeypatch, caplog):
    monkeypatch.setattr(replay, "PROGRESS_INTERVAL_S", 0.0)  # a line per request
    with caplog.at_level(logging.INFO, logger="tiering.bench"):
        assert cli.main(["--max-requests", "3"]) == 0  # pytest's stderr is no terminal
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("replayed ")]
    assert [line.split(" in ")[0] for line in lines] == [f"replayed {i} of 3 requests ({i / 3:.0%})" for i in (1, 2, 3)]


def test_hints_derived_from_the_trace_retain_a_continuing_conversation_and_release_its_last_turn():
    first = Request(0, 1024, 1, (1, 2))
    later = Request(1, 1536, 1, (1, 2, 3))  # the same conversation, one turn on
    alone = Request(2, 1024, 1, (9, 8))
    hinted = with_hints([first, later, alone], "continuation")
    assert [r.hint for r in hinted] == [{"retain": CONTINUATION_TTL_S}, {"release": True}, {"release": True}]
    assert [r.hint for r in with_hints([first, alone], "retain:1m")] == [{"retain": 60.0}, {"retain": 60.0}]
    assert [r.hint for r in with_hints([first], "release")] == [{"release": True}]
    assert with_hints([first], "none") == [first]
    for bad in ("retain:soon", "retain:-5", "ttl:60", "always"):
        with pytest.raises(ValueError, match="expected"):
            with_hints([first], bad)


def test_continuation_hints_lift_the_hit_rate_and_retaining_everything_costs_little(tmp_path, capsys):
    """A small CPU tier on the conversation trace's head: told which conversations continue,
    it keeps them and drops the finished ones; told to keep everything for a day, the cap on
    retained rows keeps it close to no hints at all."""
    config = tmp_path / "engine.yaml"
    config.write_text("cpu_bytes_to_use: 4MiB\neviction_policy: lru\n")  # 1,024 blocks of 4 KiB
    rates, retention, summaries = {}, {}, {}
    for hints in ("none", "continuation", "retain:24h"):
        output = tmp_path / f"{hints.replace(':', '-')}.json"
        argv = ["--config", str(config), "--trace", str(TRACE), "--max-requests", "2000", "--block-bytes", "4KiB"]
        argv += ["--gpu-cache-blocks", "0"]
        assert cli.main([*argv, "--hints", hints, "--quiet", "--output", str(output)]) == 0
        report = json.loads(output.read_text())
        rates[hints], retention[hints] = report["hit_rate"]["cpu"], report["cpu_tier"]["retention"]
        summaries[hints] = capsys.readouterr().out
    assert rates["continuation"] > rates["none"] + 0.02, rates
    assert rates["retain:24h"] >= rates["none"] - 0.02, rates
    # what the hints did shows in the report and the JSON
    assert set(retention["none"].values()) == {0} and "cpu tier: deadlines given" not in summaries["none"]
    assert retention["continuation"]["retentions"] > 0 and retention["continuation"]["retentions_released"] > 0
    assert retention["retain:24h"]["retentions_dropped"] > 0 and retention["retain:24h"]["retentions_released"] == 0
    assert "retention hints    continuation: retain 5m" in summaries["continuation"]
    assert (
        "every request sends retain:24h" in summaries["retain:24h"]
        and "cpu tier: deadlines given up" in summaries["retain:24h"]
    )


def test_a_gzip_trace_reads_as_its_text_and_a_cut_one_is_refused_in_one_line(tmp_path):
    import gzip

    from tiering.benchmarks.loadgen.workload import read_trace

    text = '{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}\n' * 3
    plain, packed = tmp_path / "t.jsonl", tmp_path / "t.jsonl.gz"
    plain.write_text(text)
    packed.write_bytes(gzip.compress(text.encode()))
    assert read_trace(packed) == read_trace(plain) and len(read_trace(packed)) == 3
    packed.write_bytes(gzip.compress(text.encode())[:-10])
    with pytest.raises(ValueError, match=r"t\.jsonl\.gz: not a whole gzip file"):
        read_trace(packed)


def test_tiering_bench_credits_the_shared_tier_with_the_hits_another_engine_stored(valkey_server, key_prefix, tmp_path):
    config = tmp_path / "engine.yaml"
    config.write_text(
        f"cpu_bytes_to_use: 2MiB\nsecondary_tiers:\n  - type: valkey\n    addresses: [{valkey_server.address}]\n"
        f"    key_prefix: {key_prefix}\n"
    )
    reports = []
    for run in ("first", "second"):  # two engines, one after the other, on one server
        output = tmp_path / f"{run}.json"
        args = ["--config", str(config), "--max-requests", "60", "--warm-start", "--verify", "--quiet"]
        assert cli.main([*args, "--output", str(output)]) == 0
        reports.append(json.loads(output.read_text()))
    first, second = (report["hit_rate"] for report in reports)
    assert second["valkey"] > first["valkey"] and second["total"] > first["total"]
    assert reports[1]["tiers"]["valkey"]["stats"]["counters"]["lookups_deferred"] > 0  # found by probes
