"""`SecondaryTierFactory`: builds secondary tiers from config dicts by type name.

A type name resolves, in this order, to a class registered with `register_tier`, to an
entry point of the group ``tiering.secondary_tiers`` (name = type, value =
``"package.module:ClassName"``), or, when the config carries ``module_path``, to the class
``class_name`` (default: the type name) of that module.

A tier's options are checked against its schema: the class attribute ``config_model`` (a
pydantic model) when it has one, else a model derived from its constructor's signature
(type hints, with their constraints, and defaults; options named ``*_bytes`` are sizes and
take strings such as ``"8GiB"``; no float may be NaN or infinite). A class may also define
``check_options(options: dict) -> None``, raising ValueError, for rules between options.
Unknown options are rejected. The types below (`Size`, `Count`, `Seconds`, `Delay`,
`Probability`) give a constructor's options their ranges.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import typing
from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import Annotated, Any, ClassVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ByteSize,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    create_model,
    model_validator,
)

from tiering.secondary import SecondaryTierManager

MAX_SIZE = 1 << 60


def parse_size(value: Any) -> int:
    """Bytes from an integer, an integral float or a string such as ``"8GiB"`` or ``"512 MB"``.

    Raises:
        ValueError: not a size, or not within 1 byte .. 1 EiB.
    """
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, str):
        try:
            value = int(TypeAdapter(ByteSize).validate_python(value.strip()))
        except ValidationError:
            raise ValueError(f"expected a size such as 65536, 64KiB or 8GiB; got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected a size such as 65536, 64KiB or 8GiB; got {value!r}")
    if not 0 < value <= MAX_SIZE:
        raise ValueError(f"expected a size from 1 byte to 1 EiB; got {value}")
    return value


Size = Annotated[int, BeforeValidator(parse_size)]
"""Bytes: an integer from 1 to 1 EiB, or a string such as ``"8GiB"`` or ``"512 MB"``."""
Count = Annotated[int, Field(ge=1)]
"""How many of something (threads, attempts, operations at once): an integer >= 1."""
Seconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]
"""A timeout or a period: finite seconds > 0."""
Delay = Annotated[float, Field(ge=0, allow_inf_nan=False)]
"""A delay that may be zero: finite seconds >= 0."""
Probability = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
"""A probability, 0..1."""

_FIXED_PARAMETERS = {"self", "offloading_spec", "primary_kv_view", "tier_type", "fingerprint"}  # given, not configured

ENTRY_POINT_GROUP = "tiering.secondary_tiers"

_BUILTIN_TIERS: dict[str, tuple[str, str]] = {
    "example": ("tiering.backends.example", "ExampleSecondaryTierManager"),
    "faulty": ("tiering.backends.faulty", "FaultyTier"),
    "file": ("tiering.backends.file", "FileTier"),
    "memory": ("tiering.backends.memory", "MemoryTier"),
    "s3": ("tiering.backends.s3", "S3Tier"),
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
        tier_type, tier_cls, options = cls.resolve(tier_config)
        try:
            options = validate_tier_options(tier_cls, options)
        except ValidationError as exc:
            raise _options_error(tier_type, tier_cls, exc) from None
        return tier_cls(
            offloading_spec=offloading_spec, primary_kv_view=primary_kv_view, tier_type=tier_type, **options
        )

    @classmethod
    def resolve(cls, tier_config: Mapping[str, Any]) -> tuple[str, type[SecondaryTierManager], dict[str, Any]]:
        """(type name, tier class, the other options) of a tier config.

        Raises:
            ValueError, ImportError, TypeError: as `create_secondary_tier`, for the type.
        """
        config = dict(tier_config)
        tier_type = config.pop("type", None)
        if not isinstance(tier_type, str) or not tier_type:
            raise ValueError(f"secondary tier config needs a 'type' string; got {dict(tier_config)!r}")
        tier_cls = cls._resolve(tier_type, config.pop("module_path", None), config.pop("class_name", None))
        return tier_type, tier_cls, config

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


@functools.cache
def tier_options_model(tier_cls: type[SecondaryTierManager]) -> type[BaseModel]:
    """The pydantic model of `tier_cls`'s options (see the module docstring)."""
    explicit = getattr(tier_cls, "config_model", None)
    if explicit is not None:
        return explicit
    hints = typing.get_type_hints(tier_cls.__init__, include_extras=True)
    fields: dict[str, Any] = {}
    for name, parameter in inspect.signature(tier_cls.__init__).parameters.items():
        if name in _FIXED_PARAMETERS or parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        default = ... if parameter.default is parameter.empty else parameter.default
        annotation = hints.get(name, Any)
        if name.endswith("_bytes"):
            annotation = Size if default is not None else Size | None
        fields[name] = (annotation, default)
    settings = ConfigDict(extra="forbid", arbitrary_types_allowed=True, allow_inf_nan=False)
    validators: dict[str, Any] = {}
    check = getattr(tier_cls, "check_options", None)
    if check is not None:

        def check_together(model: BaseModel) -> BaseModel:
            check({name: getattr(model, name) for name in type(model).model_fields})
            return model

        validators["check_together"] = model_validator(mode="after")(check_together)
    return create_model(f"{tier_cls.__name__}Options", __config__=settings, __validators__=validators, **fields)


def validate_tier_options(tier_cls: type[SecondaryTierManager], options: Mapping[str, Any]) -> dict[str, Any]:
    """`options` checked and converted (sizes to ints) by the tier's schema.

    Raises:
        pydantic.ValidationError: an option is unknown, missing or of the wrong type.
    """
    model = tier_options_model(tier_cls).model_validate(dict(options))
    return {name: getattr(model, name) for name in model.model_fields_set}


def describe_error(error: Mapping[str, Any], known: list[str]) -> str:
    """What a pydantic validation error means, in a config's terms (`known`: the valid keys)."""
    if error["type"] == "extra_forbidden":
        return f"unknown key; expected one of {', '.join(known)}"
    if error["type"] == "missing":
        return "required key is missing"
    return str(error["msg"]).removeprefix("Value error, ")


def _options_error(tier_type: str, tier_cls: type, exc: ValidationError) -> Exception:
    known = list(tier_options_model(tier_cls).model_fields)
    unknown = sorted(str(e["loc"][0]) for e in exc.errors() if e["type"] == "extra_forbidden")
    if unknown:
        return TypeError(f"tier type {tier_type!r} does not take {', '.join(unknown)}; it takes: {', '.join(known)}")
    details = "; ".join(f"{'.'.join(map(str, e['loc']))}: {describe_error(e, known)}" for e in exc.errors())
    return ValueError(f"tier type {tier_type!r}: {details}")
