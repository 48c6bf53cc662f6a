"""Calling a secondary tier from the engine: which optional hooks it implements, and calls
whose exceptions are logged, never passed on to the scheduler.

Thread: the scheduler thread only.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from typing import Any

from tiering.tiers.base import SecondaryTierManager

logger = logging.getLogger(__name__)

HOOKS = (
    "touch",
    "take_events",
    "enable_events",
    "on_schedule_end",
    "take_released_jobs",
    "attach_doorbell",
    "attach_row_states",
    "retain",
    "release",
)
"""The optional `SecondaryTierManager` hooks the engine calls only on the tiers that have them."""

Hooks = dict[str, list[tuple[int, SecondaryTierManager]]]
"""Per hook of `HOOKS`, the (index, tier) of each tier that implements it."""


def hooks_of(tiers: Sequence[SecondaryTierManager]) -> Hooks:
    """Which tiers implement each hook of `HOOKS`: a default (no-op) hook is not called
    each step."""
    return {name: [(idx, tier) for idx, tier in enumerate(tiers) if overrides(tier, name)] for name in HOOKS}


def overrides(tier: SecondaryTierManager, hook: str) -> bool:
    """Whether `tier` implements `hook` (a tier that does not subclass `SecondaryTierManager`
    is taken to implement every hook)."""
    return getattr(type(tier), hook, None) is not getattr(SecondaryTierManager, hook)


def attached(tier: SecondaryTierManager, hook: str, value: Any, otherwise: str) -> bool:
    """Whether `tier` took `value` through its `hook` (``attach_doorbell``,
    ``attach_row_states``); a hook that raises is logged with what follows (`otherwise`)."""
    try:
        getattr(tier, hook)(value)
    except Exception:
        logger.exception("tier %s: %s failed; %s", tier.tier_type, hook, otherwise)
        return False
    return True


def guarded(tier: SecondaryTierManager, method: str, default: Any, *args: Any) -> Any:
    """``tier.<method>(*args)`` (as a list when `default` is a list), or `default` if it
    raises: a tier's exception is logged, never passed on to the scheduler. (`lookup` keeps
    its own try, being the hottest call.)"""
    try:
        result = getattr(tier, method)(*args)
        return list(result) if isinstance(default, list) else result
    except Exception:
        logger.exception("tier %s: %s failed", tier.tier_type, method)
        return default


def new_generations(
    tiers: Sequence[SecondaryTierManager], names: Sequence[str], weight_version: str | None = None
) -> None:
    """A reset to the weights `weight_version` declares (None: none declared): each tier
    moves to them (`SecondaryTierManager.new_generation`; a hook written without the argument
    is called without it); a tier without the hook keeps its blocks, which is logged."""
    for tier, name in zip(tiers, names, strict=True):
        if overrides(tier, "new_generation"):
            try:
                takes_version = "weight_version" in inspect.signature(tier.new_generation).parameters
            except (TypeError, ValueError):  # a hook with no signature to read (a builtin, a C extension)
                takes_version = False
            guarded(tier, "new_generation", None, *((weight_version,) if takes_version else ()))
        else:
            logger.warning("tier %s keeps its blocks across a reset (it has no new_generation)", name)
