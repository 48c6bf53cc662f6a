"""One grammar of durations (`tiering.options.parse_duration`) wherever one is read: a config's
keys in seconds, a client's retention hint, and every command line that takes one."""

import pytest

from tiering import ReqContext
from tiering.config import config_from_dict
from tiering.config_check import main as config_main
from tiering.errors import ConfigError
from tiering.eviction.retention import hint_of
from tiering.options import DURATION_EXAMPLES, duration_seconds, parse_duration
from tiering.tiers.factory import block_store_parts

GOOD = {
    "300": 300.0,
    "2.5": 2.5,
    "90s": 90.0,
    "60 s": 60.0,
    "5m": 300.0,
    "5 minutes": 300.0,
    "1h": 3600.0,
    "36h": 129_600.0,
    "14d": 1_209_600.0,
    "14day": 1_209_600.0,
    "2w": 1_209_600.0,
    "1h30m": 5400.0,
    "1h 30m": 5400.0,
    "500ms": 0.5,
    "PT1M": 60.0,
    "pt5m": 300.0,
    "P1D": 86_400.0,
    "P2W": 1_209_600.0,
    "P1DT12H": 129_600.0,
    "PT0.5S": 0.5,
}
CPU = {"cpu_bytes_to_use": "1GiB"}
BAD = ["soon", "", "P", "PT", "P1Y", "P1M", "-5", "1e5", "nan", "inf", "5 m m", "5 minutes ago", "h", "1h-", "5x"]


def test_every_form_parses_to_seconds_and_anything_else_is_refused_naming_the_forms():
    assert {text: parse_duration(text) for text in GOOD} == GOOD
    assert parse_duration(300) == 300.0 and duration_seconds(0) == 0.0
    for bad in [*BAD, 0, -1, True, None, "1" * 33]:
        with pytest.raises(ValueError) as refused:
            parse_duration(bad)
        assert len(str(refused.value)) < 160
    with pytest.raises(ValueError, match=DURATION_EXAMPLES):
        parse_duration("soon")


def test_every_example_the_messages_give_parses():
    examples = DURATION_EXAMPLES.split(", ")
    assert len(examples) == 8
    for example in examples:
        assert parse_duration(example) > 0


def test_a_configs_seconds_take_a_duration_and_a_bad_one_names_its_key():
    config = config_from_dict({**CPU, "job_deadline_s": "2m", "shutdown_drain_s": "PT0S"}, "engine.yaml")
    assert config.job_deadline_s == 120.0 and config.shutdown_drain_s == 0.0
    tier = {"type": "file", "root_dir": "/tmp/kv", "op_timeout_s": "1m", "negative_ttl_s": "500ms"}
    (checked,) = config_from_dict({**CPU, "secondary_tiers": [tier]}, "engine.yaml").secondary_tiers
    _, _, settings = block_store_parts(checked)
    assert (settings.op_timeout_s, settings.negative_ttl_s) == (60.0, 0.5)
    bad = {**CPU, "secondary_tiers": [{**tier, "op_timeout_s": "soon"}]}
    with pytest.raises(ConfigError, match=r"engine.yaml.*secondary_tiers\[0\]\.op_timeout_s: expected a duration"):
        config_from_dict(bad, "engine.yaml")
    with pytest.raises(ConfigError, match=r"job_deadline_s: .*less than or equal to 86400"):
        config_from_dict({**CPU, "job_deadline_s": "2d"}, "engine.yaml")


def test_a_clients_hint_takes_the_same_grammar():
    assert hint_of(ReqContext("r", kv_transfer_params={"kv_tiering": {"retain": "P1D"}})).retain_s == 86_400.0
    assert hint_of(ReqContext("r", kv_transfer_params={"kv_tiering": {"retain": "1h30m"}})).retain_s == 5400.0


@pytest.mark.parametrize("duration", ["36h", "1h", "60s", "5m", "14day", "PT1M", "P2W"])
def test_prune_takes_every_duration_its_own_help_gives(tmp_path, capsys, duration):
    config = tmp_path / "engine.yaml"
    config.write_text(f"cpu_bytes_to_use: 1GiB\nsecondary_tiers: [{{type: file, root_dir: {tmp_path / 'kv'}}}]\n")
    assert config_main(["prune", str(config), "--unused-for", duration, "--dry-run"]) == 0
    assert "tier file: nothing to remove: no namespace unused for " in capsys.readouterr().out  # not silence
    with pytest.raises(SystemExit):
        config_main(["prune", str(config), "--unused-for", "soon"])
    assert DURATION_EXAMPLES in capsys.readouterr().err
