"""Each benchmark runs end to end on tiny sizes, so none of them rots unnoticed."""

import importlib
import json
import os
import subprocess
from pathlib import Path

import pytest

from tiering.benchmarks import file_recovery, file_tier, loadgen, s3_tier, scale, scheduler_cost, valkey_tier
from tiering.testing import mooncake_pool


def test_scheduler_cost(capsys):
    argv = ["--blocks", "64", "--repeats", "2", "--eviction-repeats", "1", "--eviction-scale", "0.001", "--json", "-"]
    scheduler_cost.main(argv)
    captured = capsys.readouterr()
    rows = ("lookup, primary hit", "on_schedule_end, nothing to do", "block-store tier's store job")
    for row in (*rows, "Eviction with a fifth", "AsyncRuntime.submit per job"):
        assert row in captured.err  # the tables go to stderr under --json -: stdout is the JSON alone
    document = json.loads(captured.out)
    assert document["benchmark"] == "scheduler_cost" and document["argv"] == argv
    assert document["cpus"] == os.cpu_count() and document["commit"] == head_commit()
    calls, eviction = document["tables"][:2]
    assert "lookup, primary hit" in [row["operation"] for row in calls["rows"]]
    assert len(calls["values"]) == 2 and all(len(pair) == 2 for pair in calls["values"][0].values())  # each round
    assert [row["tier"] for row in eviction["rows"]] == ["CPU tier", "CPU tier", "tier index", "tier index"]


def head_commit() -> str | None:
    """The checkout's HEAD, as `--json` reports it (None outside a git checkout)."""
    here = Path(__file__).resolve().parent
    done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


BENCHMARKS = ("file_recovery", "file_tier", "gpu_copy", "s3_outage", "s3_tier", "scale", "scheduler_cost")
BENCHMARKS += ("valkey_tier",) + (() if mooncake_pool.unavailable() else ("mooncake_tier",))


@pytest.mark.parametrize("name", BENCHMARKS)
def test_every_benchmark_takes_json_and_refuses_a_file_it_cannot_write_before_any_work(name, capsys, tmp_path):
    module = importlib.import_module(f"tiering.benchmarks.{name}")
    with pytest.raises(SystemExit) as exited:
        module.main(["--help"])
    assert exited.value.code == 0 and "--json FILE" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exited:
        module.main(["--json", str(tmp_path / "missing" / "out.json")])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and f"the directory {tmp_path / 'missing'} does not exist" in err


def test_versus_vllm_and_the_cli_benchmarks_take_json(capsys):
    from tiering.benchmarks.versus_vllm import __main__ as versus_vllm

    for command in ("sched", "files", "overload"):
        with pytest.raises(SystemExit):
            versus_vllm.main([command, "--help"])
        assert "--json FILE" in capsys.readouterr().out
    for argv in (["--help"], ["serve", "--help"], ["overload", "--help"]):
        with pytest.raises(SystemExit):
            loadgen.main(argv)
        assert "--json FILE" in capsys.readouterr().out


def test_file_tier(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv(file_tier.KEYS_ENV, "ab" * 32)  # the sealed sides' key, removed after
    args = ["--dir", str(tmp_path), "--total-mib", "1", "--repeats", "2", "--block-sizes", "64KiB"]
    file_tier.main([*args, "--seals", "signed,encrypted", "--json", str(tmp_path / "files.json")])
    out = capsys.readouterr().out
    for word in ("buffered", "direct", "check", "signed", "encrypted"):
        assert word in out
    (table,) = json.loads((tmp_path / "files.json").read_text())["tables"]
    assert [(row["mode"], row["op"]) for row in table["rows"][:2]] == [("buffered", "store"), ("buffered", "load")]
    runs = table["values"][f"{64 << 10} direct"]
    assert runs["bytes moved"] == 1 << 20 and len(runs["seconds"]["engine signed load"]) == 2  # each round


def test_file_recovery(capsys, tmp_path):
    file_recovery.main(["--dir", str(tmp_path), "--objects", "300", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "files" in out and "segments" in out and "ready / raw" in out and "300" in out


def test_file_tier_refuses_a_missing_directory_or_size_in_one_line(capsys, tmp_path):
    for bad, message in (
        (["--dir", str(tmp_path / "missing")], "--dir: " + str(tmp_path / "missing") + " is not a directory"),
        (["--block-sizes", "lots"], "--block-sizes: expected a size such as 65536"),
    ):
        with pytest.raises(SystemExit) as exited:
            file_tier.main(bad)
        err = capsys.readouterr().err
        assert exited.value.code == 2 and message in err and "Traceback" not in err


def test_s3_tier(capsys, s3_server, s3_bucket):
    args = ["--endpoint-url", s3_server.endpoint_url, "--bucket", s3_bucket, "--total-mib", "1", "--repeats", "1"]
    s3_tier.main([*args, "--block-sizes", "256KiB"])
    out = capsys.readouterr().out
    assert "256 KiB" in out and "store" in out and "load" in out


def test_gpu_copy(capsys):
    from tiering.benchmarks import gpu_copy

    gpu_copy.main(["--total-mib", "1", "--repeats", "1", "--block-sizes", "64KiB,256KiB"])
    out = capsys.readouterr().out
    assert "64 KiB" in out and "256 KiB" in out and "one copy_" in out


def test_overload_ramp_through_tiering_bench(capsys, caplog, tmp_path):
    output = tmp_path / "ramp.json"
    argv = ["overload", "--device-latency-s", "0.005", "--rows", "32", "--block-bytes", "65536"]
    argv += [
        "--ramp-step-s",
        "0.3",
        "--ramp",
        "0.5",
        "8",
        "--output",
        str(output),
        "--plot",
        str(tmp_path / "ramp.png"),
    ]
    assert loadgen.main(argv) == 0
    results = json.loads(output.read_text())
    assert results["absorbed_gbps"] > 0 and (tmp_path / "ramp.png").stat().st_size > 0
    assert results["source"]["cpus"] == os.cpu_count()
    for mode in ("admission", "no_admission"):
        assert [row["offered_x"] for row in results[mode]] == [0.5, 8.0]
        assert set(results[mode][0]) >= {"offered_gbps", "cascades_dropped", "gpu_stores_refused_pct", "call_p99_us"}
    assert "The tier absorbs" in capsys.readouterr().out
    # the refusals it provokes (32 rows, 8x what the tier absorbs, stores unbounded: 75-81% of
    # GPU stores refused in three runs) are counted in the tables, not logged
    assert results["no_admission"][-1]["gpu_stores_refused_pct"] > 0
    logged = [record for record in caplog.records if "cpu_bytes_to_use avoids it" in record.getMessage()]
    assert logged == []


def test_an_overload_phase_without_promotions_prints_a_dash_not_nan(capsys):
    from tiering.benchmarks import overload

    names = ("offered_x", "offered_gbps", "absorbed_gbps", "gpu_stores_refused_pct", "scheduler_call_p99_us")
    row = dict.fromkeys(names, 1.0)
    row |= {"cascades_dropped": 0, "pinned_rows_peak": 3, "promotion_p50_ms": None, "promotion_p99_ms": None}
    overload._print({"absorbed_gbps": 1.0, "admission": [row], "no_admission": [row]})
    lines = capsys.readouterr().out.splitlines()
    cells = [cell.strip() for cell in lines[-2].strip("│ ").split("│")]
    assert cells == ["1.00x", "1.00", "1.00", "0", "1.0", "3", "-", "-", "1.0"]


def test_the_serving_benchmark_says_it_needs_vllm_and_checks_its_options(capsys, tmp_path):
    """It runs in the vLLM stage (tests_vllm/test_serve_bench.py); here vLLM is not installed."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 64, "output_length": 1, "hash_ids": [1, 2]}\n')
    assert loadgen.main(["serve", "--trace", str(trace)]) == 2
    assert "tiering-bench serve needs vLLM: run it in the environment of README's third" in capsys.readouterr().err
    bad_options = (
        ["--configurations", "a,z"],
        ["--configurations", "g"],
        ["--restart-at", "5", "--configurations", "c"],
        ["--restart-at", "5", "--replicas", "2"],
        ["--restart-signal", "kill"],
        ["--scale-out-at", "5"],
        ["--kill-replica-at", "5", "--scale-out-at", "5", "--replicas", "2"],
    )
    for bad in bad_options:
        with pytest.raises(SystemExit) as exited:
            loadgen.main(["serve", "--trace", str(trace), *bad])
        assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "expected a comma-separated list of a (vLLM, prefix cache only)" in err
    assert "configuration g needs --recompute-tokens-per-s, or configuration a before it" in err
    assert "expected a comma-separated list of d (engine: CPU tier + file tier), f (" in err
    assert "--restart-at: one server only" in err
    assert "--restart-signal kill: the signal of --restart-at, which is missing" in err
    assert "--scale-out-at: a fleet's moment, with --replicas 2 or more" in err
    assert "not allowed with argument" in err  # one moment per run


def test_a_trace_thinned_by_conversation_keeps_each_conversation_whole():
    from tiering.benchmarks.loadgen.workload import Request
    from tiering.benchmarks.serve.workload import sample_conversations

    def request(ms: float, *ids: int) -> Request:
        return Request(ms, 16 * len(ids), 4, ids)

    # Every request starts with block 0 (a shared system prompt, as in the Mooncake trace);
    # conversations in order of their first request: (0, 1) is 0th, (0, 5) 1st, (0, 7) 2nd.
    trace = [request(0, 0, 1), request(1, 0, 5), request(2, 0, 1, 2), request(3, 0, 7), request(4, 0, 5, 6)]
    trace.append(request(5, 0, 1, 2, 3))
    assert sample_conversations(trace, 1) == trace
    assert [r.hash_ids for r in sample_conversations(trace, 2)] == [(0, 1), (0, 1, 2), (0, 7), (0, 1, 2, 3)]
    assert [r.timestamp_ms for r in sample_conversations(trace, 3)] == [0, 2, 5]


def test_hot_prefix_conversations_are_told_apart_past_their_system_prompt():
    """Every hot-prefix request starts with the same 24 ids: read as one id of system prompt,
    the whole workload was one conversation (a killed replica's moved conversations: one)."""
    from tiering.benchmarks.loadgen.workload import HOT_BURST, HOT_SYSTEM_BLOCKS, synthetic
    from tiering.benchmarks.serve.workload import conversations

    requests = synthetic("hot-prefix", 1 + 2 * HOT_BURST)
    numbers = conversations(requests, HOT_SYSTEM_BLOCKS)
    firsts, seconds = numbers[1 : 1 + HOT_BURST], numbers[1 + HOT_BURST :]
    assert numbers[0] == 0 and firsts == list(range(1, 1 + HOT_BURST)) and seconds == firsts
    assert set(conversations(requests)) == {0}  # the trace's one shared id does not tell them apart


def test_valkey_tier(capsys):
    valkey_tier.main(["--total-mib", "4", "--repeats", "1", "--block-sizes", "64KiB"])
    out = capsys.readouterr().out
    assert "Valkey tier vs bare valkey-glide" in out and "64 KiB" in out


def test_a_restart_splits_the_replay_at_its_time_and_measures_fifty_requests_after():
    from tiering.benchmarks.serve.restart import AFTER_RESTART, split

    arrivals = [i * 0.5 for i in range(200)]
    before, after = split(arrivals, 10.0)
    assert before == list(range(20)) and after == list(range(20, 20 + AFTER_RESTART))
    with pytest.raises(ValueError, match=r"--restart-at 500: the requests arrive from 0 to 99.5 s"):
        split(arrivals, 500)


def test_scale(capsys):
    scale.main(["--rows", "64,128", "--objects", "64,128", "--repeats", "1"])
    out = capsys.readouterr().out
    for row in ("CPU tier, lru", "CPU tier, arc", "tier index", "segments' map", "128"):
        assert row in out
    with pytest.raises(SystemExit):
        scale.main(["--rows", "8"])
    assert "each count must be at least 16" in capsys.readouterr().err


def test_the_disk_floor_reads_whole_pieces_of_data_and_skips_holes(tmp_path):
    from tiering.benchmarks.serve import floor

    piece = 8192
    tier = tmp_path / "file-tier" / "shard"
    tier.mkdir(parents=True)
    (tier / "one-block").write_bytes(b"x" * piece)
    with open(tier / "segment", "wb") as segment:  # a piece, a hole of four, a piece and a half
        segment.write(b"y" * piece)
        segment.seek(5 * piece)
        segment.write(b"z" * (piece + piece // 2))
    (tmp_path / "file-tier" / "short").write_bytes(b"w" * 100)
    fds: list[int] = []
    try:
        offsets = sorted(offset for _, offset in floor._pieces(tmp_path / "file-tier", piece, fds))
    finally:
        for fd in fds:
            os.close(fd)
    assert offsets == [0, 0, 5 * piece]  # the holes and the half piece are no pieces
    floors = floor.disk_floors(tmp_path / "file-tier", piece, {1, 3})
    assert floors is not None and set(floors) == {1, 3} and all(seconds > 0 for seconds in floors.values())
    assert floor.disk_floors(tmp_path / "file-tier" / "shard", 1 << 20, {1}) is None  # no whole piece
    with pytest.raises(ValueError, match="multiple of 4096"):
        floor.disk_floors(tmp_path, 1000, {1})


def test_versus_vllm_measures_our_side_with_the_calls_it_gives_vllms():
    from tiering.benchmarks.versus_vllm import sched

    results = sched.measure("ours", "arc")
    assert list(results) == list(sched.CALLS) and all(value > 0 for value in results.values())


def test_versus_vllm_says_why_when_pip_cannot_fetch_the_wheel(tmp_path, monkeypatch, capsys):
    from tiering.benchmarks.versus_vllm import __main__ as versus_vllm

    monkeypatch.setenv("PIP_NO_INDEX", "1")  # no index to fetch from: pip fails at once, offline
    assert versus_vllm.main(["--cache", str(tmp_path), "sched", "--rounds", "1"]) == 2
    announced, failed = capsys.readouterr().err.splitlines()[:2]
    assert announced.startswith("versus_vllm: fetching the vllm==0.33.0 wheel (about 340 MB, once) with pip into ")
    assert f"into {tmp_path / 'vllm-0.33.0'}; --cache DIR keeps it elsewhere" in announced  # never silent for minutes
    assert failed.startswith("versus_vllm: pip download vllm==0.33.0 failed: ")


def test_versus_vllm_moves_and_checks_the_blocks_of_our_file_tier_against_the_raw_pool(tmp_path):
    from tiering.benchmarks.versus_vllm import files

    results = files.measure("ours", "buffered", 64 << 10, 48, tmp_path / "ours")
    assert set(results) == {"store", "load", "raw store", "raw load"} and all(s > 0 for s in results.values())
    assert not (tmp_path / "ours").exists()  # its scratch removed


def test_versus_vllm_offers_our_manager_stores_over_a_file_tier_step_by_step(tmp_path):
    from tiering.benchmarks.versus_vllm import overload

    results = overload.measure("ours", 0.05, 0.2, tmp_path / "ours")  # about 2 blocks of 4 MiB
    assert set(results) == {"step p50 us", "step p99 us", "refused", "written GB/s", "not cascaded"}
    assert results["refused"] == 0 and results["step p99 us"] >= results["step p50 us"] > 0
    assert not (tmp_path / "ours").exists()


@pytest.mark.skipif(bool(mooncake_pool.unavailable()), reason=f"no Mooncake pool here: {mooncake_pool.unavailable()}")
@pytest.mark.timeout(180)
def test_mooncake_tier_beside_valkey():
    """In a process of its own: Mooncake's transfer engine lives in the network namespace of
    a process's first client, and this suite's earlier pools had theirs."""
    import subprocess
    import sys

    argv = ["--total-mib", "4", "--repeats", "1", "--block-sizes", "64KiB", "--segment", "64MiB"]
    command = [sys.executable, "-m", "tiering.benchmarks.mooncake_tier", *argv]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    out = " ".join(done.stdout.split())
    for row in ("mooncake store", "mooncake load", "valkey store", "valkey load"):
        assert f"64 KiB │ {row}" in out, out


def test_the_shared_memory_a_killed_servers_processes_mapped_is_found_for_removal(tmp_path):
    """A vLLM server killed with SIGKILL leaves its message queues in /dev/shm: the files its
    session's processes map are listed (`session_shm_files`) before the kill, to be removed after."""
    import os
    import subprocess
    import sys
    import uuid

    from tiering.benchmarks.serve.server import session_shm_files

    path = f"/dev/shm/tiering-bench-test-{uuid.uuid4().hex}"
    code = (
        "import mmap, sys\n"
        f"f = open({path!r}, 'w+b'); f.truncate(4096); m = mmap.mmap(f.fileno(), 4096)\n"
        "print('mapped', flush=True); sys.stdin.read()\n"
    )
    command = [sys.executable, "-c", code]
    with subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True) as child:
        try:
            assert child.stdout.readline() == b"mapped\n"
            assert path in session_shm_files(child.pid)
            assert path not in session_shm_files(os.getsid(0))  # another session's
        finally:
            child.kill()
            os.unlink(path)
