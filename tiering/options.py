"""Option types and schemas of secondary tiers: how a tier says which config keys it takes.

A block store declares its keys as a pydantic model (`BlockStore.Options`); a tier class
written from scratch declares them as its constructor's keyword arguments (type hints, with
their constraints, and defaults).
Options named ``*_bytes`` are sizes and take strings such as ``"8GiB"``; no float may be NaN
or infinite; unknown keys are rejected. The types below give options their ranges. Used at
construction time, from any one thread.
"""

from __future__ import annotations

import functools
import inspect
import math
import re
import typing
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ByteSize, ConfigDict, Field, TypeAdapter, ValidationError, create_model

from tiering.errors import TierConfigError

MAX_SIZE = 1 << 60
STRICT = ConfigDict(extra="forbid", allow_inf_nan=False, arbitrary_types_allowed=True)
"""The settings of every options model: unknown keys and NaN or infinite floats are errors."""


SIZE_UNITS = "binary: KiB, MiB, GiB or Ki, Mi, Gi; decimal: KB, MB, GB or K, M, G"
_KUBERNETES_SUFFIX = re.compile(r"(?i)([KMGTPE]i)\s*$")


def parse_size(value: Any) -> int:
    """Bytes from an integer, an integral float or a string such as ``"8GiB"``, ``"8Gi"``
    (binary: powers of 1024) or ``"512 MB"``, ``"8G"`` (decimal: powers of 1000).

    Raises:
        ValueError: not a size, or not within 1 byte .. 1 EiB.
    """
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, str):
        text = _KUBERNETES_SUFFIX.sub(r"\1B", value.strip())
        try:
            value = int(TypeAdapter(ByteSize).validate_python(text))
        except ValidationError:
            raise ValueError(f"expected a size such as 65536, 64KiB or 8GiB; got {value!r} ({SIZE_UNITS})") from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected a size such as 65536, 64KiB or 8GiB; got {value!r} ({SIZE_UNITS})")
    if not 0 < value <= MAX_SIZE:
        raise ValueError(f"expected a size from 1 byte to 1 EiB; got {value}")
    return value


Size = Annotated[int, BeforeValidator(parse_size)]
"""Bytes: an integer from 1 to 1 EiB, or a string such as ``"8GiB"`` or ``"512 MB"``."""
Count = Annotated[int, Field(ge=1)]
"""How many of something (threads, attempts, operations at once): an integer >= 1."""
MAX_SECONDS = 86_400.0
"""The longest timeout, period or delay a setting takes (a day): longer is a hang, and waits
beyond the platform's limits (``threading.TIMEOUT_MAX``, ``time_t``) fail cryptically."""
Seconds = Annotated[float, Field(gt=0, le=MAX_SECONDS, allow_inf_nan=False)]
"""A timeout or a period: seconds > 0, a day at most."""
Delay = Annotated[float, Field(ge=0, le=MAX_SECONDS, allow_inf_nan=False)]
"""A delay that may be zero: seconds >= 0, a day at most."""
Lifetime = Annotated[float, Field(gt=0, le=366 * MAX_SECONDS, allow_inf_nan=False)]
"""How long something stored may live: seconds > 0, a year at most."""
Probability = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
"""A probability, 0..1."""


class NoOptions(BaseModel):
    """The options of something that takes none."""

    model_config = STRICT


_GIVEN = {"self", "offloading_spec", "primary_kv_view", "tier_type"}  # passed by the factory, not configured


@functools.cache
def constructor_options(cls: type) -> type[BaseModel]:
    """The options model of a tier class, derived from its constructor's keyword arguments
    (see the module docstring)."""
    init = cls.__init__  # type: ignore[misc]  # the class's own constructor is what we read
    hints = typing.get_type_hints(init, include_extras=True)
    fields: dict[str, Any] = {}
    for name, parameter in inspect.signature(init).parameters.items():
        if name in _GIVEN or parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        default = ... if parameter.default is parameter.empty else parameter.default
        annotation = hints.get(name, Any)
        if name.endswith("_bytes"):
            annotation = Size if default is not None else Size | None
        fields[name] = (annotation, default)
    return create_model(f"{cls.__name__}Options", __config__=STRICT, **fields)


def validate_options(model: type[BaseModel], options: Mapping[str, Any], source: str) -> BaseModel:
    """`options` checked and converted (sizes to ints) by `model`.

    Raises:
        TierConfigError: a key is unknown, missing or of the wrong type, or a rule between
            keys fails; one problem per key, `source` naming the tier.
    """
    try:
        return model.model_validate(dict(options) if isinstance(options, Mapping) else options)
    except ValidationError as exc:
        known = list(model.model_fields)
        problems = [(key_path(error["loc"]), describe_error(error, known)) for error in exc.errors()]
        raise TierConfigError(source, problems) from None


def set_options(model: BaseModel) -> dict[str, Any]:
    """The options a validated model was given (defaults left out), by name, in the model's
    field order."""
    given = model.model_fields_set
    return {name: getattr(model, name) for name in type(model).model_fields if name in given}


def describe_error(error: Mapping[str, Any], known: list[str]) -> str:
    """What a pydantic validation error means, in a config's terms (`known`: the valid keys)."""
    if error["type"] == "extra_forbidden":
        return f"unknown key; expected one of {', '.join(known)}"
    if error["type"] == "missing":
        return "required key is missing"
    return str(error["msg"]).removeprefix("Value error, ")


def join_path(path: str, key: Any) -> str:
    """The key path of `key` under `path` (``secondary_tiers[0]`` + ``root_dir``)."""
    return f"{path}.{key}" if path else str(key)


def key_path(loc: tuple[Any, ...]) -> str:
    """A pydantic error location as a config key path: ``secondary_tiers[1].bucket``."""
    path = ""
    for part in loc:
        path = f"{path}[{part}]" if isinstance(part, int) else join_path(path, part)
    return path
