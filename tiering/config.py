"""The engine's YAML configuration, validated once at load.

```yaml
cpu_bytes_to_use: 8GiB          # int bytes or a size string
block_size: 256                 # tokens per offloaded block, a multiple of the GPU block size
eviction_policy: arc            # lru | arc | arc-s
secondary_tiers:                # looked up in this order
  - type: file
    root_dir: /mnt/nvme/kv-cache
    capacity_bytes: 200GiB
  - type: s3
    bucket: kv-cache
    endpoint_url: ${S3_ENDPOINT}   # environment variables are expanded
metrics:                        # optional: Prometheus on 127.0.0.1:9400/metrics
  port: 9400
tenants:                        # optional: shares of the CPU tier by tenant (vLLM's cache_salt)
  default_share: 0.25           # a fraction of the tier, or bytes
  quotas: {chat: 0.75}
model_version: rl-step-1200     # optional: a model that changes under one name (part of the identity)
weight_version: step-1200       # optional: the weights this engine starts with (a lasting tier's namespace)
reset_scope: all                # a reset starts new generations of the lasting tiers (cpu: keep them)
shutdown_drain_s: 5             # a graceful stop writes what only the CPU tier holds, this long at most (0: off)
```

Every problem is reported at once, each with the file, the key path
(``secondary_tiers[1].bucket``) and what was expected. YAML is parsed safely (no
arbitrary objects), duplicate keys are errors (not "the last one wins"), and a document may
hold at most `MAX_VALUES` values `MAX_DEPTH` levels deep, aliases expanded (an alias bomb
fails at once); the file must be a regular UTF-8 file of at most `MAX_CONFIG_BYTES`. Each
tier's options are checked by its own schema (`tiering.tiers.factory.tier_options`), and every
tier gets a distinct ``name`` (its type unless given; ``file-2`` for a second ``file``).

Raised errors: `tiering.errors.ConfigError`. Any thread; nothing is built.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from tiering.contract.identity import check_weight_version
from tiering.cpu.tenants import TenantsConfig
from tiering.engine.admission import AdmissionConfig
from tiering.engine.drain import SHUTDOWN_DRAIN_S
from tiering.engine.jobs import JOB_DEADLINE_S
from tiering.errors import ConfigError, TierConfigError
from tiering.eviction.policies import cache_policy_names
from tiering.eviction.retention import RETENTION_MAX_FRACTION
from tiering.options import Delay, Seconds, Size, describe_error, join_path, key_path, set_options, validate_options
from tiering.tiers.blockstore.store import BlockStore
from tiering.tiers.context import tier_name_problem, unique_names
from tiering.tiers.factory import SecondaryTierFactory, check_tier_options

_VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
MAX_CONFIG_BYTES = 1 << 20
MAX_VALUES = 100_000
MAX_DEPTH = 32


class MetricsConfig(BaseModel):
    """``metrics``: serve the engine's stats for Prometheus (needs the ``metrics`` extra)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    port: int = Field(ge=0, le=65535)
    address: str = "127.0.0.1"
    interval_s: Seconds = 1.0


class CpuTierConfig(BaseModel):
    """``cpu_tier``: the CPU tier's lifetime (`tiering.cpu.row_records`, `tiering.cpu.kept_regions`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    survive_crash: bool = False
    keep_on_stop: bool = True


class TieringConfig(BaseModel):
    """A validated configuration. ``secondary_tiers`` hold each tier's checked options
    (sizes as ints) with its ``type``, its distinct ``name``, and ``module_path`` and
    ``class_name`` when given."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    cpu_bytes_to_use: Size
    block_size: int | None = Field(default=None, gt=0)
    eviction_policy: str = "lru"
    secondary_tiers: list[dict[str, Any]] = Field(default_factory=list)
    metrics: MetricsConfig | None = None
    cpu_tier: CpuTierConfig = Field(default_factory=CpuTierConfig)
    recompute_tokens_per_s: float | None = Field(default=None, gt=0)
    request_log: str | None = Field(default=None, min_length=1)
    max_promotion_rows: int | None = Field(default=None, gt=0)
    store_reserve_rows: int | None = Field(default=None, ge=0)
    job_deadline_s: Seconds = JOB_DEADLINE_S
    retention_max_fraction: float = Field(default=RETENTION_MAX_FRACTION, ge=0, le=1)
    tenants: TenantsConfig | None = None
    model_version: str | None = Field(default=None, min_length=1, max_length=256)
    weight_version: str | None = None
    reset_scope: Literal["all", "cpu"] = "all"
    shutdown_drain_s: Delay = SHUTDOWN_DRAIN_S
    _source: str = PrivateAttr(default="<string>")

    @property
    def source(self) -> str:
        """The file the configuration was read from (or ``<string>``), for error messages."""
        return self._source

    @field_validator("weight_version")
    @classmethod
    def _printable_version(cls, value: str | None) -> str | None:
        check_weight_version(value)
        return value

    @field_validator("eviction_policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        if value.lower() not in cache_policy_names():  # LRU, Arc-S: names are not case-sensitive
            raise ValueError(f"expected one of {', '.join(cache_policy_names())}")
        return value.lower()


def load_config(path: str | os.PathLike, environ: Mapping[str, str] | None = None) -> TieringConfig:
    """Read and validate the YAML file at `path`.

    Raises:
        ConfigError: the file is missing, not a regular file (a directory, a FIFO), larger
            than `MAX_CONFIG_BYTES`, not UTF-8, or not valid YAML, or any value is invalid.
    """
    source = str(path)
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(source, [("", "not a regular file (a directory, FIFO or device?)")])
        if info.st_size > MAX_CONFIG_BYTES:
            raise ConfigError(source, [("", f"{info.st_size} bytes; a configuration is at most {MAX_CONFIG_BYTES}")])
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(source, [("", f"cannot read the file: {exc.strerror}")]) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        problem = f"not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})"
        raise ConfigError(source, [("", problem)]) from None
    return parse_config(text, source, environ)


def parse_config(text: str, source: str = "<string>", environ: Mapping[str, str] | None = None) -> TieringConfig:
    """Validate a YAML document; `source` names it in errors.

    Raises:
        ConfigError: as `load_config`.
    """
    try:
        loader = _Loader(text)
    except yaml.reader.ReaderError as exc:  # a character YAML refuses (a NUL byte ...): where it is
        line = text.count("\n", 0, exc.position) + 1
        column = exc.position - text.rfind("\n", 0, exc.position)
        problem = f"not valid YAML: character #x{exc.character:04x} is not allowed ({exc.reason})"
        raise ConfigError(source, [(f"line {line}, column {column}", problem)]) from None
    try:
        data = loader.get_single_data()
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(source, [(where, f"not valid YAML: {getattr(exc, 'problem', None) or exc}")]) from None
    except RecursionError:
        raise ConfigError(source, [("", f"nested too deeply (at most {MAX_DEPTH} levels)")]) from None
    finally:
        loader.dispose()
    if loader.duplicates:  # reported with every other problem the document has
        try:
            config_from_dict(data, source, environ)
        except ConfigError as exc:
            raise ConfigError(source, loader.duplicates + exc.problems) from None
        raise ConfigError(source, loader.duplicates)
    if data is None:
        raise ConfigError(source, [("", "the file is empty; expected settings such as 'cpu_bytes_to_use: 8GiB'")])
    return config_from_dict(data, source, environ)


def config_from_dict(data: Any, source: str, environ: Mapping[str, str] | None = None) -> TieringConfig:
    """Validate settings already parsed (a YAML document, or a serving engine's extra config:
    see `tiering.integrations.vllm`); `source` names them in errors.

    Raises:
        ConfigError: as `load_config`.
    """
    if not isinstance(data, dict):
        raise ConfigError(source, [("", f"expected a mapping of settings, got {type(data).__name__}")])
    problems: list[tuple[str, str]] = []
    try:
        data = _Expander(os.environ if environ is None else environ, problems).expand(data, "", 0)
    except _TooLarge as exc:
        raise ConfigError(source, [(exc.path, exc.message)]) from None
    tiers = data.get("secondary_tiers", [])
    if not isinstance(tiers, list):
        problems.append(("secondary_tiers", "expected a list of tier configurations"))
        tiers = []
    checked_tiers = [_check_tier(tier, f"secondary_tiers[{i}]", problems) for i, tier in enumerate(tiers)]
    _name_tiers([tier for tier in checked_tiers if tier], problems)
    _check_locations(checked_tiers, problems)
    try:
        config = TieringConfig.model_validate({**data, "secondary_tiers": [t for t in checked_tiers if t]})
    except ValidationError as exc:
        known = list(TieringConfig.model_fields)
        problems.extend((key_path(error["loc"]), describe_error(error, known)) for error in exc.errors())
    if problems:
        raise ConfigError(source, problems)
    config._source = source
    return config


def _check_tier(tier: Any, path: str, problems: list[tuple[str, str]]) -> dict[str, Any] | None:
    if not isinstance(tier, dict):
        problems.append((path, f"expected a mapping with a 'type', got {type(tier).__name__}"))
        return None
    try:
        tier_type, tier_cls, options = SecondaryTierFactory.resolve(tier)
        checked = set_options(check_tier_options(tier_type, tier_cls, options))
    except TierConfigError as exc:
        problems.extend(exc.located(path))
        return None
    problem = tier_name_problem(tier["name"]) if "name" in tier else None
    if problem is not None:
        problems.append((f"{path}.name", problem))
        return None
    if "admission" in tier:
        try:
            tier = {**tier, "admission": set_options(validate_options(AdmissionConfig, tier["admission"] or {}, path))}
        except TierConfigError as exc:
            problems.extend(exc.located(f"{path}.admission"))
            return None
    locators = {key: tier[key] for key in ("name", "module_path", "class_name", "admission") if key in tier}
    return {"type": tier_type, **locators, **checked}


def _check_locations(tiers: list[dict[str, Any] | None], problems: list[tuple[str, str]]) -> None:
    """Two block-store tiers that would keep their objects in one place are a problem
    (`BlockStore.location`)."""
    seen: dict[str, int] = {}
    for index, tier in enumerate(tiers):
        if tier is None:
            continue
        _, tier_cls, options = SecondaryTierFactory.resolve(tier)
        where = tier_cls.location(options) if issubclass(tier_cls, BlockStore) else None
        if where is None:
            continue
        if where in seen:
            problems.append(
                (
                    f"secondary_tiers[{index}]",
                    f"keeps its blocks where secondary_tiers[{seen[where]}] does ({where}): each tier would evict "
                    "and recover the other's; give each tier a place of its own",
                )
            )
        seen.setdefault(where, index)


def _name_tiers(tiers: list[dict[str, Any]], problems: list[tuple[str, str]]) -> None:
    """Give every tier a distinct ``name``: the one it was given, else its type (``-2``,
    ``-3`` ... for repeats). Two tiers given the same name are a problem."""
    given = [tier["name"] for tier in tiers if "name" in tier]
    for name in sorted({name for name in given if given.count(name) > 1}):
        problems.append(("secondary_tiers", f"two tiers are named {name!r}; names must differ"))
    names = unique_names([tier.get("name", tier["type"]) for tier in tiers])
    for tier, name in zip(tiers, names, strict=True):
        tier["name"] = name


class _Loader(yaml.SafeLoader):
    """`yaml.SafeLoader` that notes each key given twice in one mapping (`duplicates`: where,
    what) instead of letting the last one win silently."""

    def __init__(self, stream: str):
        super().__init__(stream)
        self.duplicates: list[tuple[str, str]] = []


def _construct_mapping(loader: _Loader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue  # "<<: *defaults" may be overridden by the keys beside it
        key = loader.construct_object(key_node)
        try:
            first = seen.get(key)
        except TypeError:
            continue  # an unhashable key: the constructor reports it
        mark = key_node.start_mark
        if first is not None:
            where = f"line {mark.line + 1}, column {mark.column + 1}"
            loader.duplicates.append((where, f"not valid YAML: duplicate key {key!r} (first given on line {first})"))
            continue
        seen[key] = mark.line + 1
    return loader.construct_mapping(node)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


class _TooLarge(Exception):
    def __init__(self, path: str, message: str):
        self.path, self.message = path, message


class _Expander:
    """Copies the document, replacing ``${VAR}`` in every string (a variable that is not set
    is a problem), within `MAX_VALUES` values and `MAX_DEPTH` levels."""

    def __init__(self, environ: Mapping[str, str], problems: list[tuple[str, str]]):
        self.environ, self.problems, self.values = environ, problems, 0

    def expand(self, value: Any, path: str, depth: int) -> Any:
        self.values += 1
        if self.values > MAX_VALUES:
            raise _TooLarge("", f"more than {MAX_VALUES} values once aliases are expanded (an alias bomb?)")
        if depth > MAX_DEPTH:
            raise _TooLarge(path, f"nested too deeply (at most {MAX_DEPTH} levels)")
        if isinstance(value, dict):
            return {key: self.expand(item, join_path(path, key), depth + 1) for key, item in value.items()}
        if isinstance(value, list):
            return [self.expand(item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value)]
        if isinstance(value, str):
            for name in _VARIABLE.findall(value):
                if name not in self.environ:
                    self.problems.append((path, f"environment variable {name} is not set"))
            return _VARIABLE.sub(lambda match: self.environ.get(match.group(1), match.group(0)), value)
        return value
