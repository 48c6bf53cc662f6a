"""The load generator's command line: help without torch, errors without errno prefixes."""

import json
import subprocess
import sys

import pytest


def test_help_and_version_import_no_torch():
    code = (
        "import sys\nfrom tiering.benchmarks.loadgen import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print('torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip().endswith("False") and "--log-level" in done.stdout and "--quiet" in done.stdout
    version = subprocess.run([sys.executable, "-m", "tiering.benchmarks.loadgen.cli", "--version"], capture_output=True)
    assert version.stdout.decode().startswith("tiering-bench (kv-tiering) ")


def test_errors_read_without_errno_prefixes_and_name_the_busy_port(tmp_path, capsys):
    import socket

    from tiering.benchmarks.loadgen import cli

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert cli.main(["--metrics-port", str(port), "--max-requests", "5"]) == 2
    err = capsys.readouterr().err
    assert f"--metrics-port: 127.0.0.1:{port} is in use by another process" in err and "[Errno" not in err
    unreadable = tmp_path / "engine.yaml"
    assert cli.main(["--config", str(unreadable), "--max-requests", "5"]) == 2
    assert "[Errno" not in capsys.readouterr().err


@pytest.mark.parametrize(
    ("benchmark", "hidden", "extra"),
    [
        ("s3_tier", "aiobotocore", "bench-s3"),
        ("s3_outage", "moto", "bench-s3"),
        ("valkey_tier", "glide", "bench-valkey"),
    ],
)
def test_a_benchmark_without_its_extra_names_it_in_one_line(benchmark, hidden, extra):
    code = (
        f"import runpy, sys\nsys.modules[{hidden!r}] = None  # as if not installed\n"
        f"runpy.run_module('tiering.benchmarks.{benchmark}', run_name='__main__')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr == (
        f"this benchmark needs the '{extra}' extra (no module named {hidden!r}): "
        f"pip install -c constraints.txt -e '.[{extra}]'\n"
    )


@pytest.mark.parametrize(
    ("module", "argv", "error"),
    [
        (
            "file_tier",
            ["--modes", "pagecache"],
            "--modes: expected names out of buffered, fsync, direct; got pagecache",
        ),
        ("file_tier", ["--block-sizes", "64KiB,lots"], "--block-sizes: expected a size such as"),
        ("gpu_copy", ["--block-sizes", "3MiB,2MB", "--layers", "7"], "each must split into --layers 7 equal pages"),
        ("s3_tier", ["--block-sizes", "2 megs"], "--block-sizes: expected a size such as"),
        ("valkey_tier", ["--block-sizes", "0"], "--block-sizes: expected a size from 1 byte"),
        ("overload", ["--block-bytes", "lots"], "--block-bytes: expected a size such as"),
        ("scheduler_cost", ["--hints", "continuation"], "--hints: continuation needs conversations"),
        ("scheduler_cost", ["--hints", "retain:5x"], "--hints: retain:DURATION: expected a duration such as"),
    ],
)
def test_every_benchmark_parses_sizes_and_names_alike_and_refuses_bad_ones_before_any_work(module, argv, error, capsys):
    import importlib

    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(f"tiering.benchmarks.{module}").main(argv)
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert error in lines[-1] and lines[0].startswith("usage:")  # argparse: the usage, then the error


def test_sizes_are_printed_in_binary_units():
    from tiering.benchmarks.args import format_size, sizes_arg

    assert [format_size(size) for size in sizes_arg("64KiB, 3MiB,2GiB,512")] == ["64 KiB", "3 MiB", "2 GiB", "512 B"]


def test_the_test_servers_the_benchmarks_start_import_without_pytest():
    code = (
        "import sys\nsys.modules['pytest'] = sys.modules['pytest_asyncio'] = None  # as in a bench-* venv\n"
        "import tiering.testing.processes, tiering.testing.s3_server, tiering.testing.valkey_server\n"
        "import tiering.testing\ntry:\n    tiering.testing.BlockStoreSuite\n"
        "except ImportError:\n    print('suites need pytest')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr, done.stdout) == (0, "", "suites need pytest\n")


def _preset_run(tmp_path, config_text: str, *argv: str) -> tuple[int, dict | None, str]:
    """`tiering-bench --model llama-3.1-8b` over two 600-token requests of one prompt: exit
    status, report (None: no report), stderr."""
    from tiering.benchmarks.loadgen import cli

    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}\n' * 2)
    config = tmp_path / "engine.yaml"
    config.write_text(config_text + f"secondary_tiers: [{{type: file, root_dir: {tmp_path / 'kv'}}}]\n")
    output = tmp_path / "run.json"
    argv = ("--config", str(config), "--model", "llama-3.1-8b", "--trace", str(trace), "--output", str(output), *argv)
    status = cli.main([*argv, "--gpu-cache-blocks", "0", "--quiet"])
    return status, json.loads(output.read_text()) if output.exists() else None, str(config)


@pytest.mark.parametrize(("block_size", "tokens"), [(None, 16), (32, 32)])
def test_a_preset_sizes_a_block_alike_in_check_and_in_the_bench_and_both_take_block_size(
    tmp_path, capsys, block_size, tokens
):
    """`check --model` read 16-token blocks and the bench 512-token ones (64 MiB: one CPU row)."""
    from tiering.config_check import main as config_main

    text = "cpu_bytes_to_use: 128MiB\n" + (f"block_size: {block_size}\n" if block_size else "")
    status, report, config = _preset_run(tmp_path, text)
    assert status == 0, capsys.readouterr().err
    block_bytes = tokens * 32 * 8 * 128 * 2 * 2  # llama-3.1-8b: 32 layers, 8 KV heads of 128, K and V, bf16
    assert report["inputs"]["bytes_per_block"] == block_bytes and report["inputs"]["config"]["block_size"] == tokens
    assert report["hit_rate"]["cpu"] > 0  # the second request found the first's blocks
    capsys.readouterr()
    assert config_main(["check", config, "--model", "llama-3.1-8b"]) == 0
    rows = (128 << 20) // block_bytes
    assert (
        f"block: {tokens} tokens of llama-3.1-8b = {block_bytes:,} bytes; cpu tier rows: {rows}"
        in capsys.readouterr().out
    )


def test_a_bench_whose_cpu_tier_holds_less_than_a_typical_request_says_so_and_exits_2(tmp_path, capsys):
    """It ran with one CPU row, refused every store, and exited 0 after 121 s."""
    status, report, config = _preset_run(tmp_path, "cpu_bytes_to_use: 32MiB\n")
    assert (status, report) == (2, None)
    err = " ".join(capsys.readouterr().err.split())
    assert f"{config}: cpu_bytes_to_use (33,554,432) holds 16 blocks of 16 tokens of llama-3.1-8b" in err
    assert "half the requests store 37 or more: give the CPU tier at least 77,594,624 bytes" in err


def test_a_config_typo_is_reported_before_torch_is_imported(tmp_path):
    """It took 9-15 s on a busy machine to report a typo: torch was imported first."""
    config = tmp_path / "engine.yaml"
    config.write_text("cpu_bytes_to_use: 4MiB\neviction_polcy: lru\n")
    code = (
        "import sys\nfrom tiering.benchmarks.loadgen import main\n"
        f"status = main(['--config', {str(config)!r}])\n"
        "print(status, 'torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["2", "False"], done.stderr
    assert "eviction_polcy: unknown key" in done.stderr


def test_the_benchs_hints_take_the_grammar_of_every_duration():
    from tiering.benchmarks.args import parse_hints

    assert parse_hints("retain:P1D") == ("retain", 86_400.0)
    assert parse_hints("retain:36h") == ("retain", 129_600.0)
    assert parse_hints("retain:1h30m") == ("retain", 5400.0)
