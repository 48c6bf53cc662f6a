"""The weights a vLLM engine runs, as the engine's lasting tiers name them.

vLLM keeps a weight version of its own (``EngineCore._weight_version``, vLLM 0.32: ``"default"``
until ``finish_weight_update(weight_version=...)``, ``update_weight_version`` or ``POST
/update_weight_version`` sets it). `DeclaredWeights` turns it into the version a reset moves the
lasting tiers to (`tiering.tiers.blockstore.generations`): vLLM's ``"default"``, or a version that
cannot name a namespace (logged), is none declared.

Thread: vLLM's scheduler thread (the engine core's).
"""

from __future__ import annotations

import logging

from tiering.contract.identity import check_weight_version

logger = logging.getLogger(__name__)

VLLM_DEFAULT_WEIGHT_VERSION = "default"
"""vLLM's weight version before any is set (``EngineCore._weight_version``, vLLM 0.32)."""


class DeclaredWeights:
    """The weight version in force: `version`, None where none is declared (the config's
    ``weight_version`` at start)."""

    def __init__(self, version: str | None):
        self.version = version

    def declare(self, vllm_version: str) -> bool:
        """vLLM set its weight version to `vllm_version`: make it the one in force; returns
        whether the weights changed (always, where none is declared: a reset then shares
        nothing)."""
        declared: str | None = None if vllm_version == VLLM_DEFAULT_WEIGHT_VERSION else vllm_version
        try:
            check_weight_version(declared)
        except ValueError as exc:
            logger.warning("vLLM's weight version cannot name a namespace (%s): treated as undeclared", exc)
            declared = None
        changed = declared is None or declared != self.version
        self.version = declared
        return changed
