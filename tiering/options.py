"""Option types and schemas of secondary tiers: how a tier says which config keys it takes.

A block store declares its keys as a pydantic model (`BlockStore.Options`); a tier class
written from scratch declares them as its constructor's keyword arguments (type hints, with
their constraints, and defaults).
Options named ``*_bytes`` are sizes and take strings such as ``"8GiB"``; options in seconds
(``*_s``) also take durations such as ``"30s"``, ``"5m"`` or ``"PT1M"``; no float may be NaN
or infinite; unknown keys are rejected. The types below give options their ranges. Used at
construction time, from any one thread.
"""

from __future__ import annotations

import functools
import inspect
import math
import re
import reprlib
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


def parse_address(address: str) -> tuple[str, int]:
    """(host, port) from ``"host:port"`` (an IPv6 host in brackets: ``[::1]:6379``).

    Raises:
        ValueError: not ``host:port`` with a port in 1..65535.
    """
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected host:port, such as 10.0.0.5:6379; got {address!r}")
    return host.strip("[]"), int(port)


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


DURATION_EXAMPLES = "300, 90s, 5m, 36h, 14d, 1h30m, PT5M, P2W"
"""What every duration the project reads takes (`parse_duration`), for messages and help."""
MAX_DURATION_CHARS = 32
"""The longest duration given as text: a longer one is refused before it is parsed (a
client's hint is parsed on the scheduler thread)."""
_UNIT_S = {
    **dict.fromkeys(("ms", "msec", "millisecond", "milliseconds"), 0.001),
    **dict.fromkeys(("s", "sec", "secs", "second", "seconds"), 1.0),
    **dict.fromkeys(("m", "min", "mins", "minute", "minutes"), 60.0),
    **dict.fromkeys(("h", "hr", "hrs", "hour", "hours"), 3600.0),
    **dict.fromkeys(("d", "day", "days"), 86400.0),
    **dict.fromkeys(("w", "wk", "wks", "week", "weeks"), 604800.0),
}
_NUMBER = r"(\d+(?:\.\d+)?)"
_PART = re.compile(r" ?" + _NUMBER + r" ?([a-z]+)")  # a term of "1h30m", "1h 30m", "5 minutes": one blank at most
_ISO = re.compile(
    rf"p(?:{_NUMBER}w)?(?:{_NUMBER}d)?(?:t(?=\d)(?:{_NUMBER}h)?(?:{_NUMBER}m)?(?:{_NUMBER}s)?)?"
)  # ISO 8601 without years and months (their length varies): P2W, P1D, PT1M, P1DT12H, PT0.5S
_ISO_UNITS_S = (604800.0, 86400.0, 3600.0, 60.0, 1.0)


def duration_seconds(value: Any) -> float:
    """Seconds of a duration: a number of seconds (an int, a float or its text), a text of
    numbers with units (``90s``, ``5m``, ``5 minutes``, ``36h``, ``14d``, ``2w``, ``1h30m``,
    ``500ms``) or ISO 8601 (``PT5M``, ``P1D``, ``P2W``; no years or months); at most
    `MAX_DURATION_CHARS` characters, case-insensitive, parsed in linear time. The one
    parser of durations: config keys, clients' hints and command lines. Pure; any thread.

    Raises:
        ValueError: not a finite duration >= 0 (the message shows at most ~40 characters).
    """
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"expected a duration such as {DURATION_EXAMPLES}; got {reprlib.repr(value)}")
    if isinstance(value, str):
        if len(value) > MAX_DURATION_CHARS:
            raise ValueError(f"expected a duration of at most {MAX_DURATION_CHARS} characters, got {len(value):,}")
        seconds = _text_seconds(value.strip().lower())
        if seconds is None:
            raise ValueError(f"expected a duration such as {DURATION_EXAMPLES}; got {value!r}")
    else:
        seconds = float(value)
    if not 0 <= seconds < math.inf:
        raise ValueError(f"expected a duration >= 0, got {reprlib.repr(value)}")
    return seconds


def parse_duration(value: Any) -> float:
    """Seconds of a duration > 0 (`duration_seconds`).

    Raises:
        ValueError: not a positive duration.
    """
    seconds = duration_seconds(value)
    if seconds <= 0:
        raise ValueError(f"expected a positive duration, got {reprlib.repr(value)}")
    return seconds


def _text_seconds(text: str) -> float | None:
    """Seconds of a stripped, lower-case duration text; None if it is not one."""
    if re.fullmatch(_NUMBER, text):
        return float(text)
    if text.startswith("p"):
        iso = _ISO.fullmatch(text)
        if iso is None or iso.lastindex is None:
            return None
        return sum(float(part) * unit for part, unit in zip(iso.groups(), _ISO_UNITS_S, strict=True) if part)
    seconds, end = 0.0, 0
    for part in _PART.finditer(text):
        unit = _UNIT_S.get(part[2])
        if part.start() != end or unit is None:
            return None
        seconds, end = seconds + float(part[1]) * unit, part.end()
    return seconds if end == len(text) and end > 0 else None


def _duration_text(value: Any) -> Any:
    """A config value with a duration's text (``"30s"``) turned into seconds; anything else
    as it is, for the field's own checks."""
    return duration_seconds(value) if isinstance(value, str) else value


Size = Annotated[int, BeforeValidator(parse_size)]
"""Bytes: an integer from 1 to 1 EiB, or a string such as ``"8GiB"`` or ``"512 MB"``."""
Count = Annotated[int, Field(ge=1)]
"""How many of something (threads, attempts, operations at once): an integer >= 1."""
MAX_SECONDS = 86_400.0
"""The longest timeout, period or delay a setting takes (a day): longer is a hang, and waits
beyond the platform's limits (``threading.TIMEOUT_MAX``, ``time_t``) fail cryptically."""
Seconds = Annotated[float, BeforeValidator(_duration_text), Field(gt=0, le=MAX_SECONDS, allow_inf_nan=False)]
"""A timeout or a period: seconds > 0, a day at most, or a duration's text (``"30s"``)."""
Delay = Annotated[float, BeforeValidator(_duration_text), Field(ge=0, le=MAX_SECONDS, allow_inf_nan=False)]
"""A delay that may be zero: seconds >= 0, a day at most, or a duration's text."""
Lifetime = Annotated[float, BeforeValidator(_duration_text), Field(gt=0, le=366 * MAX_SECONDS, allow_inf_nan=False)]
"""How long something stored may live: seconds > 0, a year at most, or a duration's text."""
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
