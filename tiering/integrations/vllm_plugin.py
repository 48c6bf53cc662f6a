"""vLLM's plugin of this engine: its configuration checked before vLLM loads the model, and
vLLM's weight version followed into the lasting tiers' namespaces.

vLLM builds its KV connector, and with it this engine, only once the model is loaded and its
KV cache sized: an invalid engine setting surfaced 40 s into a tiny model's start (minutes for
a large one), its one useful line among hundreds and five tracebacks. vLLM runs every
``vllm.general_plugins`` entry point in each of its processes at start (``load_general_plugins``,
vLLM 0.32 and 0.33); this package registers `register` there (pyproject.toml). It wraps
``EngineArgs.create_engine_config``, which the API server and ``LLM(...)`` call before any model
is loaded, to check a ``kv_transfer_config`` that runs this engine (`vllm_config.runs_this_engine`)
as `tiering-config check --kv-transfer-config` does: an invalid one logs one line,
``kv-tiering cannot start, invalid configuration: ...``, and raises `ConfigError` there, before
anything else starts. A config of another connector is not looked at.

It also wraps ``EngineCore.set_weight_version`` (vLLM 0.32: ``finish_weight_update(weight_version=...)``,
``update_weight_version``, ``POST /update_weight_version``), run in the engine core's process
between steps (vLLM changes weights only while generation is paused): the engine's manager takes
the version (``declare_weight_version``) and, where it changed, vLLM resets the connector
(``Scheduler.reset_connector_cache``), so that the lasting tiers move to the namespace of those
weights (`tiering.tiers.blockstore.generations`) and the CPU tier forgets the blocks of the old
ones. Later resets (``reset_prefix_cache(reset_connector=True)``) keep that version.

Thread: vLLM's main thread of each process, once (`register` is idempotent).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from tiering.errors import ConfigError
from tiering.integrations.vllm_config import check_kv_transfer_config, runs_this_engine

logger = logging.getLogger(__name__)

TRANSFER_KEYS = ("kv_connector", "kv_connector_module_path", "kv_role", "kv_connector_extra_config")
"""What the check reads of vLLM's ``KVTransferConfig``."""


def register() -> None:
    """vLLM's general plugin entry point: wraps ``EngineArgs.create_engine_config`` with
    `check_before_start` and ``EngineCore.set_weight_version`` with `follow_weight_version`
    (once per process; nothing where vLLM lacks either). Raises nothing."""
    try:
        from vllm.engine.arg_utils import EngineArgs
    except ImportError:  # another vLLM: the engine still checks itself when built
        pass
    else:
        create = EngineArgs.create_engine_config
        if not getattr(create, "checks_kv_tiering", False):
            EngineArgs.create_engine_config = _checked(create)  # type: ignore[method-assign]
    try:
        from vllm.v1.engine.core import EngineCore
    except ImportError:  # another vLLM: resets without a version share nothing, as documented
        return
    set_version = getattr(EngineCore, "set_weight_version", None)
    if set_version is not None and not getattr(set_version, "checks_kv_tiering", False):
        EngineCore.set_weight_version = _following(set_version)  # type: ignore[method-assign]


def _following(set_version: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(set_version)
    def set_weight_version(self: Any, weight_version: str) -> Any:
        result = set_version(self, weight_version)
        follow_weight_version(getattr(self, "scheduler", None), weight_version)
        return result

    set_weight_version.checks_kv_tiering = True  # type: ignore[attr-defined]
    return set_weight_version


def follow_weight_version(scheduler: Any, weight_version: str) -> None:
    """Hand vLLM's new weight version to this engine's manager behind `scheduler`'s connector
    (vLLM's ``Scheduler``; None, or another connector: nothing), and reset the connector where
    the weights changed. Scheduler thread (the engine core's), between steps; a failure is
    logged, never raised into vLLM's utility call."""
    connector = getattr(scheduler, "connector", None)
    manager = getattr(getattr(connector, "connector_scheduler", None), "manager", None)
    declare = getattr(manager, "declare_weight_version", None)
    if declare is None:
        return
    try:
        if declare(weight_version):
            scheduler.reset_connector_cache()
    except Exception:
        logger.exception("kv-tiering: could not follow vLLM's weight version %r", weight_version)


def _checked(create: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(create)
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        check_before_start(getattr(self, "kv_transfer_config", None))
        return create(self, *args, **kwargs)

    create_engine_config.checks_kv_tiering = True  # type: ignore[attr-defined]
    return create_engine_config


def check_before_start(transfer: Any) -> None:
    """Check `transfer` (vLLM's ``KVTransferConfig``, a mapping of its keys, or None) if it
    runs this engine; anything else passes unread. Any thread.

    Raises:
        ConfigError: it runs this engine with an invalid configuration (logged first, in one line).
    """
    if transfer is None:
        return
    if not isinstance(transfer, dict):
        transfer = {key: getattr(transfer, key, None) for key in TRANSFER_KEYS}
    transfer = {key: value for key, value in transfer.items() if value is not None}
    if not runs_this_engine(transfer):
        return
    try:
        check_kv_transfer_config(transfer)
    except ConfigError as exc:
        logger.error("kv-tiering cannot start, invalid configuration: %s", "; ".join(exc.lines))
        raise
