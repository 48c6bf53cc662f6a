import os
import subprocess

import pytest

from tiering.backends import FileBlockStore
from tiering.config import ConfigError, load_config, parse_config

GOOD = """
cpu_bytes_to_use: 8GiB
block_size: 256
eviction_policy: arc
secondary_tiers:
  - type: file
    root_dir: /mnt/nvme/kv-cache
    capacity_bytes: 200GiB
    max_concurrency: 16
  - type: s3
    bucket: kv-cache
    prefix: prod/
    endpoint_url: ${S3_ENDPOINT}
    capacity_bytes: 2TiB
"""


def test_a_full_config_loads_with_sizes_and_variables_resolved():
    config = parse_config(GOOD, environ={"S3_ENDPOINT": "http://127.0.0.1:9000"})
    assert config.cpu_bytes_to_use == 8 << 30
    assert (config.block_size, config.eviction_policy) == (256, "arc")
    file_tier, s3_tier = config.secondary_tiers
    assert file_tier == {
        "type": "file",
        "name": "file",
        "root_dir": "/mnt/nvme/kv-cache",
        "capacity_bytes": 200 << 30,
        "max_concurrency": 16,
    }
    assert s3_tier["endpoint_url"] == "http://127.0.0.1:9000" and s3_tier["capacity_bytes"] == 2 << 40


def test_a_duplicate_key_is_reported_with_every_other_problem():
    text = "cpu_bytes_to_use: lots\neviction_policy: lru\neviction_policy: fifo\nsecondary_tiers: [{type: nvme}]"
    with pytest.raises(ConfigError) as caught:
        parse_config(text, "engine.yaml")
    assert caught.value.lines[0] == (
        "engine.yaml: line 3, column 1: not valid YAML: duplicate key 'eviction_policy' (first given on line 2)"
    )
    text = " ".join(caught.value.lines)
    assert "cpu_bytes_to_use: expected a size" in text and "secondary_tiers[0].type: unknown tier type" in text


@pytest.mark.parametrize("written", ["LRU", "Arc-S", "arc"])
def test_a_policy_name_is_not_case_sensitive(written):
    config = parse_config(f"cpu_bytes_to_use: 1000000\neviction_policy: {written}")
    assert config.eviction_policy == written.lower()


def test_defaults():
    config = parse_config("cpu_bytes_to_use: 1000000")
    assert (config.block_size, config.eviction_policy, config.secondary_tiers) == (None, "lru", [])


BAD = [
    ("cpu_bytes_to_use: [1, 2", "line 1, column 24: not valid YAML"),
    ("cpu_bytes_to_use: 1GiB\nx: a\x00b", "line 2, column 5: not valid YAML: character #x0000 is not allowed"),
    ("- just\n- a list", "expected a mapping of settings, got list"),
    ("eviction_policy: lru", "cpu_bytes_to_use: required key is missing"),
    ("cpu_bytes_to_use: -5", "cpu_bytes_to_use: expected a size from 1 byte to 1 EiB; got -5"),
    ("cpu_bytes_to_use: 0", "cpu_bytes_to_use: expected a size from 1 byte to 1 EiB; got 0"),
    ("cpu_bytes_to_use: 1GiB\nblock_size: 0", "block_size: Input should be greater than 0"),
    ("cpu_bytes_to_use: 1GiB\neviction_policy: fifo", "eviction_policy: expected one of arc, arc-s, lru"),
    ("cpu_bytes_to_use: 1GiB\nrecompute_tokens_per_s: 0", "recompute_tokens_per_s: Input should be greater than 0"),
    ("cpu_bytes_to_use: 1GiB\nrecompute_tokens_per_s: .inf", "recompute_tokens_per_s: Input should be a finite number"),
    ("cpu_bytes_to_use: 1GiB\ncolour: blue", "colour: unknown key; expected one of cpu_bytes_to_use, block_size"),
    (  # beyond the platform's waits (a cryptic "timestamp out of range" at start before)
        "cpu_bytes_to_use: 1GiB\nsecondary_tiers: [{type: memory, open_timeout_s: 1.0e+10}]",
        "secondary_tiers[0].open_timeout_s: Input should be less than or equal to 86400",
    ),
    (
        "cpu_bytes_to_use: 1GiB\nsecondary_tiers: [{type: memory, shutdown_timeout_s: 86401}]",
        "secondary_tiers[0].shutdown_timeout_s: Input should be less than or equal to 86400",
    ),
    (
        "cpu_bytes_to_use: 1GiB\nmetrics: {port: 1, interval_s: 1.0e+10}",
        "metrics.interval_s: Input should be less than",
    ),
    (
        "cpu_bytes_to_use: 1GiB\nsecondary_tiers: [{type: file, root_dir: /tmp/kv-a}, {type: file, root_dir: /tmp/./kv-a/}]",
        "secondary_tiers[1]: keeps its blocks where secondary_tiers[0] does (file /tmp/kv-a): each tier would evict",
    ),
    (
        "cpu_bytes_to_use: 1GiB\nsecondary_tiers: [{type: s3, bucket: b, prefix: p/}, {type: s3, bucket: b, prefix: p/}]",
        "secondary_tiers[1]: keeps its blocks where secondary_tiers[0] does (s3 bucket 'b', prefix 'p/' at the",
    ),
    (
        "cpu_bytes_to_use: 1GiB\nsecondary_tiers: [{type: file, root_dir: '~no-such-user-here/kv'}]",
        "secondary_tiers[0].root_dir: ~no-such-user-here/kv: no such user's home directory to expand '~' to",
    ),
    (
        "cpu_bytes_to_use: 1GiB\nsecondary_tiers: {type: file}",
        "secondary_tiers: expected a list of tier configurations",
    ),
    ("cpu_bytes_to_use: 1GiB\nsecondary_tiers: [7]", "secondary_tiers[0]: expected a mapping with a 'type', got int"),
    (
        "cpu_bytes_to_use: 1GiB\nsecondary_tiers: [{root_dir: /x}]",
        "secondary_tiers[0].type: expected a tier type such as 'file'; got None",
    ),
    (
        "cpu_bytes_to_use: 1GiB\nsecondary_tiers: [{type: nvme}]",
        "secondary_tiers[0].type: unknown tier type; known types: example, faulty, file, memory, mooncake, redis, s3, valkey",
    ),
    ("cpu_bytes_to_use: 1GiB\nsecondary_tiers: [{type: file}]", "secondary_tiers[0].root_dir: required key is missing"),
    (
        "cpu_bytes_to_use: 1GiB\nsecondary_tiers: [{type: file, root_dir: /x, backoff_s: 5, max_backoff_s: 1}]",
        "secondary_tiers[0]: max_backoff_s (1.0) is below backoff_s (5.0)",
    ),
    (
        "cpu_bytes_to_use: 1GiB\nsecondary_tiers: [{type: s3, prefix: p/}]",
        "secondary_tiers[0].bucket: required key is missing",
    ),
    (
        "cpu_bytes_to_use: 1GiB\nsecondary_tiers: [{type: file, root_dir: /x, capacity_bytes: lots}]",
        "secondary_tiers[0].capacity_bytes: expected a size such as 65536, 64KiB or 8GiB; got 'lots'",
    ),
    (
        "cpu_bytes_to_use: 1GiB\nsecondary_tiers: [{type: file, root_dir: /x, speed: 9}]",
        "secondary_tiers[0].speed: unknown key; expected one of root_dir, io_threads, fsync, direct_io, layout, shared, capacity_bytes",
    ),
    (
        "cpu_bytes_to_use: 1GiB\nsecondary_tiers: [{type: memory, max_concurrency: many}]",
        "secondary_tiers[0].max_concurrency: Input should be a valid integer",
    ),
    (
        "cpu_bytes_to_use: 1GiB\nsecondary_tiers: [{type: s3, bucket: b, endpoint_url: '${NOT_SET}'}]",
        "secondary_tiers[0].endpoint_url: environment variable NOT_SET is not set",
    ),
]


def test_every_problem_is_reported_at_once():
    text = "cpu_bytes_to_use: 0\neviction_policy: mru\nsecondary_tiers: [{type: file}, {type: warp}]"
    with pytest.raises(ConfigError) as caught:
        parse_config(text, "engine.yaml", environ={})
    paths = [path for path, _ in caught.value.problems]
    assert paths == ["secondary_tiers[0].root_dir", "secondary_tiers[1].type", "cpu_bytes_to_use", "eviction_policy"]


def test_load_config_reads_files_and_reports_unreadable_ones(tmp_path):
    path = tmp_path / "engine.yaml"
    path.write_text("cpu_bytes_to_use: 64MiB\n")
    assert load_config(path).cpu_bytes_to_use == 64 << 20
    with pytest.raises(ConfigError, match=r"missing\.yaml: cannot read the file"):
        load_config(tmp_path / "missing.yaml")


def test_yaml_is_loaded_safely():
    with pytest.raises(ConfigError, match="not valid YAML"):
        parse_config("cpu_bytes_to_use: !!python/object/apply:os.system ['echo pwned']")


BOMB = "a: &a ['x','x','x','x','x','x','x','x','x']\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]\n"
    for i in range(8)
)  # "billion laughs": 9 ** 9 strings once expanded

HOSTILE = [
    # sizes and numbers
    ("cpu_bytes_to_use: 8EiB", "cpu_bytes_to_use: expected a size from 1 byte to 1 EiB; got 9223372036854775808"),
    ("cpu_bytes_to_use: 1e30", "cpu_bytes_to_use: expected a size such as 65536, 64KiB or 8GiB; got '1e30'"),
    (
        "cpu_bytes_to_use: 1.0e+30",
        "cpu_bytes_to_use: expected a size from 1 byte to 1 EiB; got 1000000000000000019884624838656",
    ),
    ("cpu_bytes_to_use: .nan", "cpu_bytes_to_use: expected a size such as 65536, 64KiB or 8GiB; got nan"),
    ("cpu_bytes_to_use: 1.5", "cpu_bytes_to_use: expected a size such as 65536, 64KiB or 8GiB; got 1.5"),
    ("cpu_bytes_to_use: true", "cpu_bytes_to_use: expected a size such as 65536, 64KiB or 8GiB; got True"),
    (
        "cpu_bytes_to_use: 1GiB\nmetrics: {port: 1, interval_s: .inf}",
        "metrics.interval_s: Input should be a finite number",
    ),
    (
        "cpu_bytes_to_use: 1GiB\nsecondary_tiers: [{type: memory, op_timeout_s: .nan}]",
        "secondary_tiers[0].op_timeout_s: Input should be a finite number",
    ),
    (
        "cpu_bytes_to_use: 1GiB\nsecondary_tiers: [{type: memory, op_timeout_s: 0}]",
        "secondary_tiers[0].op_timeout_s: Input should be greater than 0",
    ),
    (
        "cpu_bytes_to_use: 1GiB\nsecondary_tiers: [{type: memory, latency_s: -1}]",
        "secondary_tiers[0].latency_s: Input should be greater than or equal to 0",
    ),
    (
        "cpu_bytes_to_use: 1GiB\nsecondary_tiers: [{type: memory, failure_rate: 2}]",
        "secondary_tiers[0].failure_rate: Input should be less than or equal to 1",
    ),
    (
        "cpu_bytes_to_use: 1GiB\nsecondary_tiers: [{type: memory, max_concurrency: 0}]",
        "secondary_tiers[0].max_concurrency: Input should be greater than or equal to 1",
    ),
    (
        "cpu_bytes_to_use: 1GiB\nsecondary_tiers: [{type: memory, capacity_bytes: 1e30}]",
        "secondary_tiers[0].capacity_bytes: expected a size such as 65536, 64KiB or 8GiB; got '1e30'",
    ),
    (
        "cpu_bytes_to_use: 1GiB\nsecondary_tiers: [{type: file, root_dir: /tmp/t, io_threads: 0}]",
        "secondary_tiers[0].io_threads: Input should be greater than or equal to 1",
    ),
    (
        "cpu_bytes_to_use: 1GiB\nsecondary_tiers: [{type: file, root_dir: /tmp/t, batch_bytes: -1}]",
        "secondary_tiers[0].batch_bytes: expected a size from 1 byte to 1 EiB; got -1",
    ),
    (
        "cpu_bytes_to_use: 1GiB\nsecondary_tiers: [{type: s3, bucket: b, max_attempts: 0}]",
        "secondary_tiers[0].max_attempts: Input should be greater than or equal to 1",
    ),
    (
        "cpu_bytes_to_use: 1GiB\nsecondary_tiers: [{type: s3, bucket: b, read_timeout_s: 30}]",
        "secondary_tiers[0]: connect_timeout_s (2.0) and read_timeout_s (30.0) must be below op_timeout_s (20.0)",
    ),
    (
        "cpu_bytes_to_use: 1GiB\nsecondary_tiers: [{type: faulty, inner: {type: memory}, latency_s: .inf}]",
        "secondary_tiers[0].latency_s: Input should be a finite number",
    ),
    (
        "cpu_bytes_to_use: 1GiB\nsecondary_tiers: [{type: faulty, inner: {type: file, root_dir: /tmp/t, io_threads: 0}}]",
        "secondary_tiers[0].inner: io_threads: Input should be greater than or equal to 1",
    ),
    # structure
    (
        "cpu_bytes_to_use: 1GiB\ncpu_bytes_to_use: 2GiB",
        "line 2, column 1: not valid YAML: duplicate key 'cpu_bytes_to_use' (first given on line 1)",
    ),
    (
        "cpu_bytes_to_use: 1GiB\nsecondary_tiers: [{type: memory, seed: 1, seed: 2}]",
        "line 2, column 43: not valid YAML: duplicate key 'seed'",
    ),
    ("", "the file is empty"),
    ("# only a comment\n", "the file is empty"),
    ("cpu_bytes_to_use: 1GiB\n" + BOMB, "more than 100000 values once aliases are expanded (an alias bomb?)"),
    ("cpu_bytes_to_use: 1GiB\nx: " + "[" * 5000 + "]" * 5000, "nested too deeply (at most 32 levels)"),
    ("cpu_bytes_to_use: 1GiB\nx: " + "[" * 40 + "]" * 40, "x" + "[0]" * 32 + ": nested too deeply (at most 32 levels)"),
    (
        "cpu_bytes_to_use: 1GiB\nsecondary_tiers: [{type: file, root_dir: ''}]",
        "secondary_tiers[0].root_dir: must not be empty",
    ),
    (
        "cpu_bytes_to_use: 1GiB\nsecondary_tiers: [{type: file, root_dir: /etc/hostname}]",
        "secondary_tiers[0].root_dir: /etc/hostname is not a directory",
    ),
    (
        "cpu_bytes_to_use: 1GiB\nsecondary_tiers: [{type: file, root_dir: /etc/hostname/kv}]",
        "secondary_tiers[0].root_dir: /etc/hostname/kv cannot be used: Not a directory",
    ),
    (
        "cpu_bytes_to_use: 1GiB\nsecondary_tiers: [{type: file, root_dir: /tmp}]",
        "secondary_tiers[0].root_dir: /tmp is writable by group or others (mode 1777)",
    ),
]


@pytest.mark.parametrize(("text", "message"), BAD + HOSTILE, ids=range(len(BAD) + len(HOSTILE)))
def test_bad_input_fails_at_load_naming_the_file_the_key_path_and_what_was_expected(text, message):
    with pytest.raises(ConfigError) as caught:
        parse_config(text, "engine.yaml", environ={})
    assert f"engine.yaml: {message}" in str(caught.value)


def test_a_root_dir_under_home_is_expanded_never_made_literally(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    text = "cpu_bytes_to_use: 1GiB\nsecondary_tiers: [{type: file, root_dir: ~/kv}, {type: file, root_dir: ~/kv2}]"
    first, second = parse_config(text, environ={}).secondary_tiers
    assert (first["root_dir"], second["root_dir"]) == (str(tmp_path / "home" / "kv"), str(tmp_path / "home" / "kv2"))
    assert FileBlockStore("~/kv", bytes(16)).root_dir == tmp_path / "home" / "kv"
    assert not (tmp_path / "~").exists()


def test_shared_tier_options_may_use_a_merge_key_and_override_it():
    text = "cpu_bytes_to_use: 1GiB\nsecondary_tiers:\n  - &slow {type: memory, latency_s: 0.5}\n  - {<<: *slow, latency_s: 0.1}"
    slow, fast = parse_config(text, environ={}).secondary_tiers
    assert (slow["latency_s"], fast["latency_s"], fast["type"]) == (0.5, 0.1, "memory")


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda path: path.write_bytes(b"cpu_bytes_to_use: \xff\xfe 1GiB"), "not UTF-8 text (byte 0xff at offset 18)"),
        (lambda path: path.mkdir(), "not a regular file"),
        (lambda path: os.mkfifo(path), "not a regular file"),  # reading it would block forever
        (lambda path: None, "cannot read the file: No such file or directory"),
        (lambda path: path.write_bytes(b"#" * (2 << 20)), "2097152 bytes; a configuration is at most 1048576"),
    ],
    ids=["non-utf8", "directory", "fifo", "missing", "huge"],
)
def test_unusable_config_files_name_the_file(tmp_path, make, message):
    path = tmp_path / "engine.yaml"
    make(path)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert f"{path}: {message}" in str(caught.value)


def test_a_root_dir_that_cannot_be_created_fails_at_load(small_disk):
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    text = f"cpu_bytes_to_use: 1GiB\nsecondary_tiers: [{{type: file, root_dir: {small_disk}/kv}}]"
    with pytest.raises(
        ConfigError, match=f"root_dir: {small_disk}/kv cannot be created: {small_disk} is not a writable"
    ):
        parse_config(text, "engine.yaml", environ={})


def test_tiers_get_distinct_names_and_a_given_name_is_checked():
    text = "cpu_bytes_to_use: 1GiB\nsecondary_tiers: [{type: memory}, {type: memory}, {type: memory, name: slow}]"
    assert [tier["name"] for tier in parse_config(text).secondary_tiers] == ["memory", "memory-2", "slow"]
    clash = "cpu_bytes_to_use: 1GiB\nsecondary_tiers: [{type: memory, name: a}, {type: example, name: a}]"
    with pytest.raises(ConfigError, match="secondary_tiers: two tiers are named 'a'; names must differ"):
        parse_config(clash)
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\].name: expected 1-64 letters"):
        parse_config("cpu_bytes_to_use: 1GiB\nsecondary_tiers: [{type: memory, name: 'a/b'}]")


def test_a_shared_tier_under_per_process_block_hashes_is_warned_about(caplog):
    """vLLM seeds xxhash per process unless PYTHONHASHSEED is set: a file, S3 or Valkey tier
    would then never hit across engines, nor after a restart."""
    from tiering.integrations.vllm_config import warn_unshared_hashes

    shared = parse_config("cpu_bytes_to_use: 1MiB\nsecondary_tiers: [{type: file, root_dir: /tmp/kv, name: nvme}]")
    private = parse_config("cpu_bytes_to_use: 1MiB\nsecondary_tiers: [{type: memory}]")
    assert warn_unshared_hashes(shared, "xxhash", environ={})
    assert "vLLM hashes blocks with xxhash and a seed of its own in each process" in caplog.text
    assert "tiers nvme will hold blocks that no other engine" in caplog.text
    assert not warn_unshared_hashes(shared, "xxhash", environ={"PYTHONHASHSEED": "0"})
    assert not warn_unshared_hashes(shared, "sha256", environ={})
    assert not warn_unshared_hashes(private, "xxhash_cbor", environ={})
