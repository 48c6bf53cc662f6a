"""The vLLM plugin (`tiering.integrations.vllm_plugin`) without vLLM: it is registered where vLLM
looks for plugins, and its check refuses an invalid configuration of this engine in one line
while passing every other connector's unread. Under a real vLLM: tests_vllm/test_start_checks.py."""

import importlib.metadata
import logging
from types import SimpleNamespace

import pytest

from tiering import ConfigError
from tiering.integrations import VLLM_CONNECTOR, VLLM_SPEC
from tiering.integrations.vllm_plugin import check_before_start, register

BAD = {"cpu_bytes_to_use": "lots", "secondary_tiers": [{"type": "fs"}]}


def test_the_plugin_is_an_entry_point_vllm_runs_in_each_process():
    (plugin,) = [ep for ep in importlib.metadata.entry_points(group="vllm.general_plugins") if ep.name == "kv_tiering"]
    assert plugin.load() is register
    register()  # without vLLM: nothing to wrap, nothing raised


@pytest.mark.parametrize(
    "transfer",
    [
        {**VLLM_CONNECTOR, "kv_connector_extra_config": BAD},  # a mapping, as LLM(kv_transfer_config=...) takes
        SimpleNamespace(**VLLM_CONNECTOR, kv_connector_extra_config=BAD),  # vLLM's KVTransferConfig
        {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": VLLM_SPEC | BAD},
    ],
    ids=["mapping", "object", "offloading-connector"],
)
def test_an_invalid_configuration_of_this_engine_is_one_log_line_and_a_config_error(transfer, caplog):
    with caplog.at_level(logging.ERROR), pytest.raises(ConfigError) as caught:
        check_before_start(transfer)
    (record,) = caplog.records
    line = record.getMessage()
    assert "\n" not in line and line.startswith("kv-tiering cannot start, invalid configuration: ")
    assert "secondary_tiers[0].root_dir: required key is missing" in line
    assert all(problem in line for problem in caught.value.lines)


@pytest.mark.parametrize(
    "transfer",
    [
        None,
        {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_connector_extra_config": BAD},
        {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": BAD},  # vLLM's spec
        SimpleNamespace(kv_connector=None, kv_connector_module_path=None, kv_role=None, kv_connector_extra_config={}),
        {**VLLM_CONNECTOR, "kv_connector_extra_config": {"cpu_bytes_to_use": "1GiB"}},  # ours, valid
    ],
)
def test_other_connectors_and_a_valid_configuration_pass(transfer, caplog):
    check_before_start(transfer)
    assert caplog.records == []


def test_vllms_weight_version_is_the_version_a_reset_moves_to_and_default_declares_none(caplog):
    from tiering.integrations.vllm_weights import DeclaredWeights

    weights = DeclaredWeights(None)
    assert weights.declare("default") and weights.version is None  # vLLM's before any is set: shares nothing
    assert weights.declare("step-1") and weights.version == "step-1"
    assert not weights.declare("step-1")  # the same weights: no reset
    assert weights.declare("step 2") and weights.version is None  # cannot name a namespace: undeclared, logged
    assert "treated as undeclared" in caplog.text


def test_the_plugin_resets_the_connector_only_where_the_weights_changed():
    from tiering.integrations.vllm_plugin import follow_weight_version
    from tiering.integrations.vllm_weights import DeclaredWeights

    resets = []
    manager = SimpleNamespace(declare_weight_version=DeclaredWeights("step-1").declare)
    scheduler = SimpleNamespace(
        connector=SimpleNamespace(connector_scheduler=SimpleNamespace(manager=manager)),
        reset_connector_cache=lambda: resets.append(True),
    )
    for version in ("step-1", "step-2", "step-2"):
        follow_weight_version(scheduler, version)
    assert len(resets) == 1
    follow_weight_version(SimpleNamespace(connector=None), "step-3")  # vLLM without a connector: nothing
