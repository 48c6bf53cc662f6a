"""The command lines users meet first: `tiering-config check`, and `tiering-bench`'s own
flags and start-up cost."""

import json

import pytest

from tiering import TieringOffloadingManager, TieringOffloadingSpec, parse_config
from tiering.config_check import main as config_main
from tiering.integrations import VLLM_CONNECTOR, VLLM_SPEC
from tiering.options import parse_size


def test_check_prints_the_resolved_engine_without_building_it(tmp_path, capsys):
    config = tmp_path / "engine.yaml"
    config.write_text(
        f"cpu_bytes_to_use: 8Gi\nblock_size: 256\nsecondary_tiers:\n"
        f"  - {{type: file, root_dir: {tmp_path / 'kv'}, capacity_bytes: 200GiB}}\n"
        f"  - {{type: memory, admission: {{min_reuse: 2}}}}\n"
    )
    assert config_main(["check", str(config), "--model", "llama-3.1-8b"]) == 0
    out = capsys.readouterr().out
    assert "cpu tier: 8,589,934,592 bytes, eviction policy lru" in out
    assert "block: 256 tokens of llama-3.1-8b = 33,554,432 bytes; cpu tier rows: 256" in out
    assert "tier file: type file, root_dir=" in out and "capacity_bytes=214748364800" in out
    assert "tier memory: type memory, default options" in out and "min_reuse=2" in out
    assert "max_rows_in_flight=64" in out and "writeback_window=32" in out and "None" not in out  # 256 rows, 2 tiers
    assert not (tmp_path / "kv").exists()  # nothing was built
    assert config_main(["check", str(config)]) == 0  # no model: the rows are not known
    out = capsys.readouterr().out
    assert "max_rows_in_flight and writeback_window sized by the CPU tier's rows (--model prints them)" in out
    assert "None" not in out


def test_check_with_a_model_refuses_what_the_engine_would_refuse(tmp_path, capsys):
    config = tmp_path / "engine.yaml"
    config.write_text(
        f"cpu_bytes_to_use: 1MiB\nsecondary_tiers: [{{type: file, root_dir: {tmp_path}, capacity_bytes: 1MiB}}]\n"
    )
    assert config_main(["check", str(config)]) == 0  # no model: no block size to check against
    assert config_main(["check", str(config), "--model", "llama-3.1-8b"]) == 2  # 2 MiB blocks
    err = " ".join(capsys.readouterr().err.split())
    assert "cpu_bytes_to_use holds no whole block of 2,097,152 bytes: the engine would not start" in err
    assert "secondary_tiers[0].capacity_bytes (1,048,576) cannot hold one block: a block takes at least" in err


def test_check_puts_what_would_stop_the_engine_last_under_the_header_of_every_config_error(tmp_path, capsys):
    config = tmp_path / "engine.yaml"
    config.write_text("cpu_bytes_to_use: 1PiB\nsecondary_tiers: [{type: file, root_dir: /proc/kv-cache}]\n")
    assert config_main(["check", str(config)]) == 2
    out, err = capsys.readouterr()
    assert "cpu tier: 1,125,899,906,842,624 bytes" in out
    header, *problems = err.splitlines()
    assert header == "invalid configuration" and len(problems) == 2 and all(line.startswith("  ") for line in problems)
    assert "cpu_bytes_to_use (1,125,899,906,842,624) is more than /dev/shm has free on this machine" in problems[0]
    assert "secondary_tiers[0]: root_dir: /proc/kv-cache: cannot create a file in /proc" in problems[1]


def test_check_of_a_bad_config_names_the_key_and_exits_2(tmp_path, capsys):
    config = tmp_path / "engine.yaml"
    config.write_text("cpu_bytes_to_use: 8Gi\nsecondary_tiers: [{type: file}]\n")
    assert config_main(["check", str(config)]) == 2
    assert "engine.yaml: secondary_tiers[0].root_dir: required key is missing" in capsys.readouterr().err


def test_check_takes_vllms_kv_transfer_config_as_given_to_vllm_serve(tmp_path, capsys):
    """vLLM builds the engine only after loading the model: the same JSON checks in a second
    without vLLM (this venv has none), with the errors the spec would raise under vLLM."""
    extra = {"cpu_bytes_to_use": "64MiB", "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path / "kv")}]}
    ours = {**VLLM_CONNECTOR, "kv_connector_extra_config": extra}
    theirs = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
    theirs["kv_connector_extra_config"] = extra | VLLM_SPEC
    for transfer in (ours, theirs):
        assert config_main(["check", "--kv-transfer-config", json.dumps(transfer), "--model", "llama-3.1-8b"]) == 0
        assert "tier file: type file, root_dir=" in capsys.readouterr().out  # vLLM's "fs" is the file tier
    assert not (tmp_path / "kv").exists()

    def errors(transfer) -> str:
        assert config_main(["check", "--kv-transfer-config", transfer]) == 2
        return capsys.readouterr().err

    bad_tier = {**ours, "kv_connector_extra_config": {"secondary_tiers": [{"type": "fs", "capacity": 5}]}}
    err = errors(json.dumps(bad_tier))
    assert "kv_connector_extra_config: secondary_tiers[0].capacity: unknown key" in err
    assert "kv_connector_extra_config: secondary_tiers[0].root_dir: required key is missing" in err
    err = errors(json.dumps({"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {}}))
    assert "kv_transfer_config: kv_connector_extra_config.spec_name: expected 'KVTieringOffloadingSpec'" in err
    assert "kv_transfer_config: kv_role: required with kv_connector" in err
    assert "'LMCacheConnectorV1' does not run this engine; use 'KVTieringConnector'" in errors(
        json.dumps({**ours, "kv_connector": "LMCacheConnectorV1"})
    )
    assert "kv_transfer_config: not JSON: Expecting" in errors('{"kv_connector": ')
    with pytest.raises(SystemExit):
        config_main(["check"])  # neither a file nor --kv-transfer-config
    assert "give a YAML file or --kv-transfer-config" in capsys.readouterr().err


def test_sizes_take_kubernetes_units_and_say_which_units_are_decimal():
    assert (parse_size("8Gi"), parse_size("8GiB"), parse_size("8G"), parse_size("8GB")) == (8 << 30, 8 << 30, 8e9, 8e9)
    with pytest.raises(ValueError, match=r"got 'lots' \(binary: KiB, MiB, GiB or Ki, Mi, Gi; decimal: KB, MB, GB"):
        parse_size("lots")


def test_the_spec_and_the_manager_are_context_managers(tmp_path):
    from tiering import KVLayout
    from tiering.cpu.shared_region import region_path

    config = parse_config("cpu_bytes_to_use: 64KiB\nsecondary_tiers: [{type: memory}]")
    with TieringOffloadingSpec(config, KVLayout("t", 1, 64), "ctx-test") as spec, spec.get_manager() as manager:
        assert isinstance(manager, TieringOffloadingManager)
        assert region_path("ctx-test").exists()
    assert not region_path("ctx-test").exists()


def test_an_s3_endpoint_from_the_environment_is_named_as_such(monkeypatch):
    from tiering.backends.s3 import S3BlockStore

    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:1")
    store = S3BlockStore(b"\0" * 16, "bucket")
    assert "bucket 'bucket' at http://127.0.0.1:1 (from AWS_ENDPOINT_URL_S3)" in str(store._open_error(OSError("x")))


def test_check_tries_what_it_cheaply_can_and_with_connect_reaches_the_servers(
    tmp_path, capsys, monkeypatch, s3_server, s3_bucket, valkey_server
):
    """A path every permission check passes for root (containers run as root) but that
    cannot hold a file, an S3 tier without credentials, a server that does not answer: each
    is found before the engine starts, and nothing is left behind."""
    config = tmp_path / "engine.yaml"
    config.write_text(
        "cpu_bytes_to_use: 1MiB\nsecondary_tiers:\n"
        "  - {type: file, root_dir: /proc/kv-cache}\n"
        f"  - {{type: file, root_dir: {tmp_path / 'kv'}, name: fine}}\n"
        f"  - {{type: s3, bucket: {s3_bucket}, prefix: p/, endpoint_url: '{s3_server.endpoint_url}'}}\n"
        f"  - {{type: valkey, addresses: ['{valkey_server.address}'], connect_timeout_s: 1}}\n"
    )
    assert config_main(["check", str(config)]) == 2
    out, err = capsys.readouterr()
    assert "secondary_tiers[0]: root_dir: /proc/kv-cache: cannot create a file in /proc" in err
    assert "secondary_tiers[1]" not in err and "secondary_tiers[2]" not in err and "secondary_tiers[3]" not in err
    assert "servers not reached: --connect opens each tier's store" in out
    assert sorted(path.name for path in tmp_path.iterdir()) == ["engine.yaml"]  # the try left nothing
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    assert config_main(["check", str(config)]) == 2
    assert "secondary_tiers[2]: no AWS credentials in the chain" in capsys.readouterr().err
    monkeypatch.undo()
    config.write_text(
        "cpu_bytes_to_use: 1MiB\nsecondary_tiers:\n"
        f"  - {{type: s3, bucket: {s3_bucket}, prefix: p/, endpoint_url: '{s3_server.endpoint_url}'}}\n"
        f"  - {{type: valkey, addresses: ['{valkey_server.address}'], connect_timeout_s: 1}}\n"
        f"  - {{type: s3, bucket: missing-{s3_bucket}, prefix: p/, endpoint_url: '{s3_server.endpoint_url}'}}\n"
    )
    assert config_main(["check", str(config), "--connect"]) == 2
    err = capsys.readouterr().err
    assert "secondary_tiers[2]: cannot be reached: " in err and "does not exist" in err
    assert "secondary_tiers[0]" not in err and "secondary_tiers[1]" not in err


def test_the_top_level_help_shows_each_commands_options(capsys):
    with pytest.raises(SystemExit):
        config_main(["--help"])
    out = capsys.readouterr().out
    assert "--connect" in out and "--model" in out and "--unused-for DURATION" in out and "--dry-run" in out
