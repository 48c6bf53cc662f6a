"""`SecondaryTierFactory`: builds secondary tiers from config dicts by type name.

A type name resolves, in this order, to a class registered with `register_tier`, to an
entry point of the group ``tiering.secondary_tiers`` (name = type, value =
``"package.module:ClassName"``), or, when the config carries ``module_path``, to the class
``class_name`` (default: the type name) of that module.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import Any, ClassVar

from tiering.secondary import SecondaryTierManager

ENTRY_POINT_GROUP = "tiering.secondary_tiers"

_BUILTIN_TIERS: dict[str, tuple[str, str]] = {
    "example": ("backends.example", "ExampleSecondaryTierManager"),
    "file": ("backends.file", "FileTier"),
    "memory": ("backends.memory", "MemoryTier"),
    "s3": ("backends.s3", "S3Tier"),
}


class SecondaryTierFactory:
    """Registry of secondary-tier types. Used at construction time, from any one thread."""

    _registry: ClassVar[dict[str, tuple[str, str]]] = dict(_BUILTIN_TIERS)

    @classmethod
    def register_tier(cls, tier_type: str, module_path: str, class_name: str) -> None:
        """Make `tier_type` build ``module_path.class_name`` (imported when first used).

        Raises:
            ValueError: `tier_type` is already registered to another class.
        """
        current = cls._registry.get(tier_type)
        if current is not None and current != (module_path, class_name):
            raise ValueError(f"tier type {tier_type!r} is already registered to {current[0]}.{current[1]}")
        cls._registry[tier_type] = (module_path, class_name)

    @classmethod
    def supported_types(cls) -> list[str]:
        """Registered and entry-point tier types, sorted."""
        return sorted({*cls._registry, *(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))})

    @classmethod
    def create_secondary_tier(
        cls, tier_config: Mapping[str, Any], primary_kv_view: memoryview, offloading_spec: Any
    ) -> SecondaryTierManager:
        """Build the tier described by `tier_config`.

        Args:
            tier_config: ``type`` picks the class; ``module_path`` and ``class_name`` locate
                an unregistered one; every other key is a constructor keyword argument.
            primary_kv_view: the primary rows, 2-D memoryview ``(num_blocks, row_bytes)``.
            offloading_spec: the spec building the tier, or None.

        Raises:
            ValueError: ``type`` is missing, or names no known tier and no ``module_path``
                is given (the message lists the supported types).
            ImportError: the tier's module cannot be imported or lacks the class.
            TypeError: the class is not a `SecondaryTierManager`, or the config has keys its
                constructor does not take (the message lists the keys it takes).
        """
        config = dict(tier_config)
        tier_type = config.pop("type", None)
        if not isinstance(tier_type, str) or not tier_type:
            raise ValueError(f"secondary tier config needs a 'type' string; got {dict(tier_config)!r}")
        tier_cls = cls._resolve(tier_type, config.pop("module_path", None), config.pop("class_name", None))
        _check_kwargs(tier_type, tier_cls, config)
        return tier_cls(offloading_spec=offloading_spec, primary_kv_view=primary_kv_view, tier_type=tier_type, **config)

    @classmethod
    def _resolve(cls, tier_type: str, module_path: str | None, class_name: str | None) -> type[SecondaryTierManager]:
        if module_path is not None:
            target = (module_path, class_name or tier_type)
        elif tier_type in cls._registry:
            target = cls._registry[tier_type]
        else:
            found = entry_points(group=ENTRY_POINT_GROUP, name=tier_type)
            if not found:
                raise ValueError(
                    f"unknown secondary tier type {tier_type!r}; supported types: "
                    f"{', '.join(cls.supported_types())} (or give 'module_path' for an out-of-tree class)"
                )
            module, _, attr = next(iter(found)).value.partition(":")
            target = (module, attr)
        module_name, attr = target
        try:
            tier_cls = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ImportError(f"tier type {tier_type!r}: cannot load {module_name}:{attr}: {exc}") from exc
        if not (isinstance(tier_cls, type) and issubclass(tier_cls, SecondaryTierManager)):
            raise TypeError(f"tier type {tier_type!r}: {module_name}:{attr} is not a SecondaryTierManager subclass")
        return tier_cls


def _check_kwargs(tier_type: str, tier_cls: type, config: dict[str, Any]) -> None:
    params = inspect.signature(tier_cls).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    fixed = {"offloading_spec", "primary_kv_view", "tier_type"}
    accepted = [name for name in params if name not in fixed]
    unknown = sorted(set(config) - set(accepted))
    if unknown:
        raise TypeError(
            f"tier type {tier_type!r} does not take {', '.join(unknown)}; "
            f"it takes: {', '.join(accepted) or 'no options'}"
        )
