"""`SecondaryTierFactory`: the one registry of tier types, and how a tier config is built.

A type name resolves, in this order, to a class given by the config itself (``module_path``
and ``class_name``, default: the type name), to a class registered with `register_tier`, or
to an entry point of the group ``tiering.secondary_tiers`` (name = type, value =
``"package.module:ClassName"``). The built-in types are entry points of this package like any
third party's, so the engine's core imports no backend.

A registered class is either

- a `BlockStore`: its tier is a `BlockStoreTier` whose keys are the adapter's
  (`BlockStoreSettings`, with the store's `tier_defaults`) plus the store's own (`Options`);
- or a `SecondaryTierManager`: its keys are its constructor's keyword arguments (see
  `tiering.options.constructor_options`).

Reserved keys of every tier config: ``type``, ``name`` (the tier's name in stats, metrics
and logs; default: the type), ``module_path``, ``class_name``, and ``admission`` (what the
manager lets through to the tier: `tiering.engine.admission.AdmissionConfig`). Used at construction time,
from any one thread.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import Any, ClassVar

from pydantic import BaseModel, create_model, model_validator

from tiering.errors import TierConfigError
from tiering.options import STRICT, constructor_options, set_options, validate_options
from tiering.tiers.base import SecondaryTierManager
from tiering.tiers.blockstore import BlockStore, BlockStoreSettings, BlockStoreTier
from tiering.tiers.context import TierContext

ENTRY_POINT_GROUP = "tiering.secondary_tiers"
RESERVED_KEYS = ("type", "name", "module_path", "class_name", "admission")

TierClass = type[SecondaryTierManager] | type[BlockStore]


class SecondaryTierFactory:
    """The registry of secondary-tier types, and the builder of tiers from config dicts."""

    _registry: ClassVar[dict[str, tuple[str, str]]] = {}

    @classmethod
    def register_tier(cls, tier_type: str, module_path: str, class_name: str) -> None:
        """Make `tier_type` build ``module_path.class_name`` (imported when first used), a
        `SecondaryTierManager` or a `BlockStore` subclass.

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
            tier_config: ``type`` picks the class (see the module docstring); the other keys
                are its options.
            primary_kv_view: the primary rows, 2-D memoryview ``(num_blocks, row_bytes)``.
            offloading_spec: the spec building the tier, or None (see `TierContext.of`).

        Raises:
            TierConfigError: no ``type``, an unknown type (the message lists the known ones),
                a class that cannot be imported or is not a tier, or bad options (one
                problem per key, with the keys it takes).
            OSError, TimeoutError, TieringError: the tier's storage cannot be opened.
        """
        tier_type, tier_cls, options = cls.resolve(tier_config)
        checked = check_tier_options(tier_type, tier_cls, options)
        context = TierContext.of(offloading_spec, primary_kv_view, tier_type)
        try:
            context = context.named(tier_config.get("name", context.name))
        except ValueError as exc:
            raise TierConfigError(f"tier type {tier_type!r}", [("name", str(exc))]) from None
        if issubclass(tier_cls, BlockStore):
            store_cls = tier_cls
            store_options, settings = _split(store_cls, checked)

            def make_store(fingerprint: bytes) -> BlockStore:
                return store_cls.from_config(fingerprint, store_options, settings)

            return BlockStoreTier(context, primary_kv_view, tier_type, make_store, settings)
        return tier_cls(
            offloading_spec=context, primary_kv_view=primary_kv_view, tier_type=tier_type, **set_options(checked)
        )

    @classmethod
    def resolve(cls, tier_config: Mapping[str, Any]) -> tuple[str, TierClass, dict[str, Any]]:
        """(type name, class, the options: every key but the reserved ones) of a tier config.

        Raises:
            TierConfigError: as `create_secondary_tier`, for the type.
        """
        options = dict(tier_config)
        tier_type = options.pop("type", None)
        for key in RESERVED_KEYS[1:]:
            options.pop(key, None)
        if not isinstance(tier_type, str) or not tier_type:
            raise TierConfigError(
                "secondary tier", [("type", f"expected a tier type such as 'file'; got {tier_type!r}")]
            )
        return tier_type, cls._load(tier_type, tier_config.get("module_path"), tier_config.get("class_name")), options

    @classmethod
    def _load(cls, tier_type: str, module_path: str | None, class_name: str | None) -> TierClass:
        source = f"tier type {tier_type!r}"
        if module_path is not None:
            module_name, attr = module_path, class_name or tier_type
        elif tier_type in cls._registry:
            module_name, attr = cls._registry[tier_type]
        else:
            found = entry_points(group=ENTRY_POINT_GROUP, name=tier_type)
            if not found:
                known = ", ".join(cls.supported_types())
                problem = f"unknown tier type; known types: {known} (or give 'module_path' for an out-of-tree class)"
                raise TierConfigError(source, [("type", problem)])
            module_name, _, attr = next(iter(found)).value.partition(":")
        try:
            tier_cls = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise TierConfigError(source, [("type", f"cannot load {module_name}:{attr}: {exc}")]) from exc
        if not (isinstance(tier_cls, type) and issubclass(tier_cls, SecondaryTierManager | BlockStore)):
            problem = f"{module_name}:{attr} is neither a SecondaryTierManager nor a BlockStore subclass"
            raise TierConfigError(source, [("type", problem)])
        return tier_cls


def block_store_parts(tier_config: Mapping[str, Any]) -> tuple[type[BlockStore], BaseModel, BlockStoreSettings] | None:
    """(store class, its options, the tier's settings) of a block-store tier's config, as the
    tier would be built; None for a tier class written from scratch.

    Raises:
        TierConfigError: as `SecondaryTierFactory.create_secondary_tier`, for the config.
    """
    tier_type, tier_cls, options = SecondaryTierFactory.resolve(tier_config)
    if not issubclass(tier_cls, BlockStore):
        return None
    return (tier_cls, *_split(tier_cls, check_tier_options(tier_type, tier_cls, options)))


def check_tier_options(tier_type: str, tier_cls: TierClass, options: Mapping[str, Any]) -> BaseModel:
    """`options` of a tier of `tier_cls` checked and converted (sizes to ints).

    Raises:
        TierConfigError: one problem per bad key, or for a rule between keys.
    """
    return validate_options(tier_options(tier_cls), options, f"tier type {tier_type!r}")


@functools.cache
def tier_options(tier_cls: TierClass) -> type[BaseModel]:
    """The options model of a tier class (see the module docstring)."""
    if not issubclass(tier_cls, BlockStore):
        return constructor_options(tier_cls)
    store_cls = tier_cls
    clash = set(store_cls.Options.model_fields) & (set(BlockStoreSettings.model_fields) | set(RESERVED_KEYS))
    if clash:
        raise TypeError(f"{store_cls.__name__}.Options redefines adapter keys: {', '.join(sorted(clash))}")
    fields: dict[str, Any] = {}
    for name, info in BlockStoreSettings.model_fields.items():
        default = store_cls.tier_defaults.get(name, info.default)
        fields[name] = (info.rebuild_annotation(), default)

    def check_together(model: BaseModel) -> BaseModel:
        own, settings = _split(store_cls, model)
        if settings.integrity is not None and not store_cls.supports_integrity:
            raise ValueError(f"integrity: {store_cls.__name__} cannot seal its objects (no supports_integrity)")
        store_cls.check_config(own, settings)
        return model

    class Strict(store_cls.Options):  # type: ignore[name-defined]
        model_config = STRICT  # unknown keys are errors, whatever the store's own model allows

    return create_model(
        f"{store_cls.__name__}TierOptions",
        __base__=Strict,
        __validators__={"check_together": model_validator(mode="after")(check_together)},  # type: ignore[dict-item]
        **fields,
    )


def _split(store_cls: type[BlockStore], checked: BaseModel) -> tuple[BaseModel, BlockStoreSettings]:
    """The store's `Options` and the adapter's `BlockStoreSettings` of a validated tier config."""
    own = store_cls.Options.model_construct(**{key: getattr(checked, key) for key in store_cls.Options.model_fields})
    values = {key: getattr(checked, key) for key in BlockStoreSettings.model_fields}
    return own, BlockStoreSettings.model_validate(values)  # validated again: its rules between keys
