"""An invalid engine configuration under a real vLLM fails before vLLM loads the model, with its
one line first (`tiering.integrations.vllm_plugin`, run by vLLM's plugin loader in each process).
Before the plugin it took about 40 s on the tiny model, its line among 246 lines and 5 tracebacks."""

import json

import pytest

from tests_vllm import tiny
from tiering import ConfigError
from tiering.benchmarks.serve.server import ServerOptions, VllmServer
from tiering.integrations import VLLM_CONNECTOR

pytestmark = pytest.mark.timeout(600)
BAD = {"cpu_bytes_to_use": "lots", "secondary_tiers": [{"type": "fs"}]}
LINE = "kv-tiering cannot start, invalid configuration: "
MODEL_LOADS = ("Starting to load model", "Loading weights took", "Model loading took")
"""What vLLM logs as it loads a model: none of it may come before the refusal."""


def test_a_server_with_an_invalid_configuration_stops_before_loading_the_model_with_its_line_first(model, tmp_path):
    transfer = json.dumps({**VLLM_CONNECTOR, "kv_connector_extra_config": BAD})
    options = ServerOptions(block_size=tiny.BLOCK, max_model_len=1024, gpu_blocks=64, kv_transfer_config=transfer)
    with pytest.raises(RuntimeError, match="did not start") as refused:
        VllmServer(model, options, tmp_path / "server.log", start_timeout_s=240)
    output = (tmp_path / "server.log").read_text()
    assert LINE in output, str(refused.value)
    assert "secondary_tiers[0].root_dir: required key is missing" in output
    assert not any(phrase in output for phrase in MODEL_LOADS), output[-3000:]
    assert "EngineCore" not in output.split(LINE)[0]  # no engine process was started for it
    assert "Traceback" not in output.split(LINE)[0]  # the line comes first


def test_an_offline_llm_with_an_invalid_configuration_raises_the_config_error_before_loading(model, caplog):
    with pytest.raises(ConfigError) as refused:
        tiny.make_llm(model, BAD, connector="KVTieringConnector")
    assert "kv_connector_extra_config: cpu_bytes_to_use: expected a size" in str(refused.value)
    assert LINE in caplog.text
    assert not any(phrase in caplog.text for phrase in MODEL_LOADS)
