"""The engine's settings inside vLLM's ``kv_transfer_config``, read without importing vLLM.

vLLM builds its KV connector, and with it this engine, only once the model is loaded and
its KV cache sized (vLLM 0.32 and 0.33: ``ensure_kv_transfer_initialized``, in the
worker's ``initialize_from_config``): an invalid engine setting surfaces minutes into a
large model's start, inside vLLM's tracebacks. `check_kv_transfer_config` runs the same
validation first, in a second and without vLLM installed::

    tiering-config check --kv-transfer-config '{"kv_connector": "KVTieringConnector", ...}'

Thread: any.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tiering.config import TieringConfig, config_from_dict, load_config
from tiering.errors import ConfigError
from tiering.integrations import VLLM_CONNECTOR, VLLM_SPEC

SOURCE = "kv_connector_extra_config"
"""How errors name the engine's keys given in vLLM's extra config."""
TRANSFER_SOURCE = "kv_transfer_config"
"""How errors name vLLM's own keys around them."""
VLLM_KEYS = frozenset({"spec_name", "spec_module_path", "offload_prompt_only", "self_describing_kv_events"})
"""Extra-config keys that are vLLM's own, not the engine's."""
TIER_ALIASES = {"fs": "file", "obj": "s3"}
"""vLLM's tier type names, accepted for ours."""
PER_PROCESS_HASHES = frozenset({"xxhash", "xxhash_cbor"})
"""vLLM's ``--prefix-caching-hash-algo`` values it seeds with random bytes per process
unless ``PYTHONHASHSEED`` is set (vLLM 0.32, 0.33: ``resolve_none_hash_seed``)."""
PRIVATE_TIER_TYPES = frozenset({"memory"})
"""Tier types whose blocks no other process reads and that do not outlive the engine."""

logger = logging.getLogger(__name__)


def engine_config(extra_config: Mapping[str, Any], tokens_per_row: int | None) -> TieringConfig:
    """The engine's `TieringConfig` from vLLM's extra config: the YAML configuration's keys,
    or ``config_file: PATH`` naming such a file; vLLM's own keys (`VLLM_KEYS`) are skipped
    and its tier names (`TIER_ALIASES`) accepted. `tokens_per_row`: tokens per CPU row as
    vLLM resolved them, which a file's ``block_size`` must equal; None where not known yet.

    Raises:
        ConfigError: a key is unknown or invalid, ``config_file`` is given with engine keys,
            or its ``block_size`` differs from `tokens_per_row`.
    """
    settings = {key: value for key, value in extra_config.items() if key not in VLLM_KEYS}
    path = settings.pop("config_file", None)
    if path is not None:
        if settings.keys() - {"block_size"}:
            raise ConfigError(SOURCE, [("config_file", f"give the engine's settings in {path} or here, not both")])
        config = load_config(Path(path))
        if tokens_per_row is not None and config.block_size not in (None, tokens_per_row):
            raise ConfigError(str(path), [("block_size", f"vLLM offloads blocks of {tokens_per_row} tokens")])
        return config
    tiers = settings.get("secondary_tiers")
    if isinstance(tiers, list):
        settings["secondary_tiers"] = [_unalias(tier) for tier in tiers]
    return config_from_dict(settings, SOURCE)


def _unalias(tier: Any) -> Any:
    """A tier config with vLLM's type name (``fs``, ``obj``) replaced by ours."""
    if isinstance(tier, dict) and tier.get("type") in TIER_ALIASES:
        return {**tier, "type": TIER_ALIASES[tier["type"]]}
    return tier


def check_kv_transfer_config(value: str | Mapping[str, Any]) -> TieringConfig:
    """Validate vLLM's KV-transfer config for this engine as vLLM would build it, without vLLM:
    `value` is ``vllm serve``'s ``--kv-transfer-config`` JSON or the mapping given to
    ``LLM(kv_transfer_config=...)``. Returns the engine's `TieringConfig`; builds nothing
    (no shared memory, no tier opened).

    Raises:
        ConfigError: `value` is not a JSON object; it does not run this engine (the
            connector is neither this engine's ``KVTieringConnector`` nor vLLM's
            ``OffloadingConnector`` naming this engine's spec) or has no ``kv_role``; or an
            engine key is invalid, as `engine_config` raises. Every problem names its key path.
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ConfigError(TRANSFER_SOURCE, [("", f"not JSON: {exc}")]) from None
    if not isinstance(value, Mapping):
        raise ConfigError(TRANSFER_SOURCE, [("", f"expected a JSON object, got {type(value).__name__}")])
    extra = value.get(SOURCE, {})
    if not isinstance(extra, Mapping):
        raise ConfigError(TRANSFER_SOURCE, [(SOURCE, f"expected a mapping, got {type(extra).__name__}")])
    problems = _connector_problems(value, extra)
    if problems:
        raise ConfigError(TRANSFER_SOURCE, problems)
    return engine_config(extra, None)


def runs_this_engine(transfer: Mapping[str, Any]) -> bool:
    """Whether vLLM's KV-transfer keys `transfer` name this engine: its own connector, or
    vLLM's ``OffloadingConnector`` with this engine's spec. Any thread; pure."""
    connector = transfer.get("kv_connector")
    extra = transfer.get(SOURCE)
    spec = extra.get("spec_name") if isinstance(extra, Mapping) else None
    return connector == VLLM_CONNECTOR["kv_connector"] or (
        connector == "OffloadingConnector" and spec == VLLM_SPEC["spec_name"]
    )


def _connector_problems(transfer: Mapping[str, Any], extra: Mapping[str, Any]) -> list[tuple[str, str]]:
    """What keeps `transfer` from building this engine, as (key path, problem) pairs."""
    connector = transfer.get("kv_connector")
    problems = []
    if connector == VLLM_CONNECTOR["kv_connector"]:
        expected = VLLM_CONNECTOR["kv_connector_module_path"]
        if transfer.get("kv_connector_module_path") != expected:
            problems.append(("kv_connector_module_path", f"expected {expected!r} with {connector}"))
        spec = {**VLLM_SPEC, **{key: extra[key] for key in VLLM_SPEC if key in extra}}
    elif connector == "OffloadingConnector":
        spec = {key: extra.get(key) for key in VLLM_SPEC}
    else:
        return [
            (
                "kv_connector",
                f"{connector!r} does not run this engine; use {VLLM_CONNECTOR['kv_connector']!r} "
                f"(kv_connector_module_path {VLLM_CONNECTOR['kv_connector_module_path']!r}), or 'OffloadingConnector' "
                f"with {SOURCE} {json.dumps(VLLM_SPEC)}",
            )
        ]
    problems += [
        (f"{SOURCE}.{key}", f"expected {expected!r} for this engine, got {spec[key]!r}")
        for key, expected in VLLM_SPEC.items()
        if spec[key] != expected
    ]
    if transfer.get("kv_role") is None:
        problems.append(("kv_role", f"required with kv_connector; use {VLLM_CONNECTOR['kv_role']!r}"))
    return problems


def warn_unshared_hashes(config: TieringConfig, hash_algo: str, environ: Mapping[str, str] = os.environ) -> bool:
    """Warn, once at start, where vLLM's block hashes differ from one process to the next
    (`hash_algo` in `PER_PROCESS_HASHES` without ``PYTHONHASHSEED``) while a secondary tier
    is shared or outlives the process (any type but `PRIVATE_TIER_TYPES`): no other engine,
    nor this one after a restart, would ever find its blocks there. Returns whether it
    warned."""
    lasting = [tier["name"] for tier in config.secondary_tiers if tier["type"] not in PRIVATE_TIER_TYPES]
    if hash_algo not in PER_PROCESS_HASHES or "PYTHONHASHSEED" in environ or not lasting:
        return False
    logger.warning(
        "vLLM hashes blocks with %s and a seed of its own in each process (PYTHONHASHSEED is not set): tiers %s "
        "will hold blocks that no other engine, nor this one after a restart, ever finds. Set PYTHONHASHSEED to one "
        "value for every engine that shares them, or use --prefix-caching-hash-algo sha256 (vLLM's default)",
        hash_algo,
        ", ".join(lasting),
    )
    return True
