import pytest

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
        "root_dir": "/mnt/nvme/kv-cache",
        "capacity_bytes": 200 << 30,
        "max_concurrency": 16,
    }
    assert s3_tier["endpoint_url"] == "http://127.0.0.1:9000" and s3_tier["capacity_bytes"] == 2 << 40


def test_defaults():
    config = parse_config("cpu_bytes_to_use: 1000000")
    assert (config.block_size, config.eviction_policy, config.secondary_tiers) == (None, "lru", [])


BAD = [
    ("cpu_bytes_to_use: [1, 2", "line 1, column 24: not valid YAML"),
    ("- just\n- a list", "expected a mapping of settings, got list"),
    ("eviction_policy: lru", "cpu_bytes_to_use: required key is missing"),
    ("cpu_bytes_to_use: -5", "cpu_bytes_to_use: could not parse value and unit from byte string"),
    ("cpu_bytes_to_use: 0", "cpu_bytes_to_use: Input should be greater than 0"),
    ("cpu_bytes_to_use: 1GiB\nblock_size: 0", "block_size: Input should be greater than 0"),
    ("cpu_bytes_to_use: 1GiB\neviction_policy: fifo", "eviction_policy: expected one of arc, lru"),
    ("cpu_bytes_to_use: 1GiB\ncolour: blue", "colour: unknown key; expected one of cpu_bytes_to_use, block_size"),
    (
        "cpu_bytes_to_use: 1GiB\nsecondary_tiers: {type: file}",
        "secondary_tiers: expected a list of tier configurations",
    ),
    ("cpu_bytes_to_use: 1GiB\nsecondary_tiers: [7]", "secondary_tiers[0]: expected a mapping with a 'type', got int"),
    (
        "cpu_bytes_to_use: 1GiB\nsecondary_tiers: [{root_dir: /x}]",
        "secondary_tiers[0].type: secondary tier config needs a 'type'",
    ),
    (
        "cpu_bytes_to_use: 1GiB\nsecondary_tiers: [{type: nvme}]",
        "secondary_tiers[0].type: unknown secondary tier type 'nvme'; supported types: example, faulty, file, memory, s3",
    ),
    ("cpu_bytes_to_use: 1GiB\nsecondary_tiers: [{type: file}]", "secondary_tiers[0].root_dir: required key is missing"),
    (
        "cpu_bytes_to_use: 1GiB\nsecondary_tiers: [{type: s3, prefix: p/}]",
        "secondary_tiers[0].bucket: required key is missing",
    ),
    (
        "cpu_bytes_to_use: 1GiB\nsecondary_tiers: [{type: file, root_dir: /x, capacity_bytes: lots}]",
        "secondary_tiers[0].capacity_bytes: could not parse value",
    ),
    (
        "cpu_bytes_to_use: 1GiB\nsecondary_tiers: [{type: file, root_dir: /x, speed: 9}]",
        "secondary_tiers[0].speed: unknown key; expected one of root_dir, capacity_bytes",
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


@pytest.mark.parametrize(("text", "message"), BAD, ids=[message.split(":")[0] for _, message in BAD])
def test_bad_input_names_the_file_the_key_path_and_what_was_expected(text, message):
    with pytest.raises(ConfigError) as caught:
        parse_config(text, "engine.yaml", environ={})
    assert f"engine.yaml: {message}" in str(caught.value)


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
