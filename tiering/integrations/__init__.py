"""Adapters to serving engines (optional extras; importing `tiering` imports none of them).

Thread: see each adapter. Imports: any part of `tiering` (which imports none of them).
"""

VLLM_SPEC = {"spec_name": "KVTieringOffloadingSpec", "spec_module_path": "tiering.integrations.vllm"}
"""The ``kv_connector_extra_config`` keys that put this engine behind vLLM's `OffloadingConnector`."""

VLLM_CONNECTOR = {
    "kv_connector": "KVTieringConnector",
    "kv_connector_module_path": "tiering.integrations.vllm_connector",
    "kv_role": "kv_both",
}
"""The ``kv_transfer_config`` keys of this engine's own connector (`vllm_connector`), which
builds `VLLM_SPEC` unless the extra config names another spec."""
