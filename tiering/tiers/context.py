"""`TierContext`: what a secondary tier gets from the engine that builds it.

Built once per tier, at construction, on the thread that builds the engine; read-only after.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from tiering.contract.identity import CHECKPOINT
from tiering.tiers.object_format import layout_fingerprint
from tiering.tiers.runtime import AsyncRuntime

TIER_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
PRIMARY_NAME = "cpu"  # the primary tier's name in stats, metrics and reports
RESERVED_NAMES = frozenset({PRIMARY_NAME, "gpu"})  # the primary tier and the GPU


def tier_name_problem(name: object) -> str | None:
    """What is wrong with `name` as a secondary tier's name, or None if it is fine: 1-64
    letters, digits, ``_``, ``.`` or ``-`` (it is a Prometheus label, a key of the stats and
    a column of the load generator), and not ``cpu`` or ``gpu``."""
    if not isinstance(name, str) or not TIER_NAME.fullmatch(name):
        return f"expected 1-64 letters, digits, '_', '.' or '-'; got {name!r}"
    if name in RESERVED_NAMES:
        return f"{name!r} names the {name.upper()} in stats and reports; choose another"
    return None


@dataclass(frozen=True)
class TierContext:
    """Attributes:
    name: the tier's name in stats, metrics and logs (the type, unless the config gives
        ``name``, or ``type-2`` for the second tier of a type).
    primary_rows: the primary tier's rows, a 2-D memoryview ``(num_blocks, row_bytes)``.
    layout_fingerprint: 16 bytes naming the engine's identity (`EngineIdentity.digest`); a
        lasting tier keeps its objects in a namespace named by it and the weights in force
        (`tiering.contract.identity.namespace`), so engines of another identity, or on
        other weights, never read them.
    runtime: the event loop the engine's tiers share, or None: a tier that needs one
        makes its own.
    spec: the `TieringOffloadingSpec` that built the tier, or None (standalone use).
    manifest: the identity in plain words (`EngineIdentity.manifest`), or None where the
        tier was built without an engine (standalone use: only the row size is known).
    weight_version: the weights the engine starts with, as the deployment declares them
        (`tiering.contract.identity.CHECKPOINT`: none declared, the checkpoint's); with the
        fingerprint it names a lasting tier's namespace.
    """

    name: str
    primary_rows: memoryview
    layout_fingerprint: bytes
    runtime: AsyncRuntime | None = None
    spec: Any = None
    manifest: Mapping[str, Any] | None = None
    weight_version: str = CHECKPOINT

    @classmethod
    def of(cls, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str) -> TierContext:
        """The context of a tier built with the contract's arguments: `offloading_spec` is a
        `TierContext` (the factory passes one), an object with a ``tier_context(view, name)``
        method (a `TieringOffloadingSpec`), or None (a fingerprint of the row size, no shared
        runtime, named `tier_type`).

        Raises:
            TypeError: `offloading_spec` is none of these.
        """
        if isinstance(offloading_spec, TierContext):
            return offloading_spec
        if offloading_spec is None:
            rows = memoryview(primary_kv_view)
            return cls(tier_type, rows, layout_fingerprint(f"row_bytes={_row_bytes(rows)}"))
        make = getattr(offloading_spec, "tier_context", None)
        if make is None:
            raise TypeError(
                f"offloading_spec must be a TierContext, a spec with tier_context(), or None; got {offloading_spec!r}"
            )
        return make(primary_kv_view, tier_type)

    def named(self, name: str) -> TierContext:
        """This context under another name.

        Raises:
            ValueError: `name` is not a valid tier name (see `tier_name_problem`).
        """
        problem = tier_name_problem(name)
        if problem is not None:
            raise ValueError(problem)
        return replace(self, name=name)


def _row_bytes(rows: memoryview) -> int:
    shape = rows.shape or ()
    return shape[1] if len(shape) == 2 else rows.nbytes


def unique_names(names: list[str]) -> list[str]:
    """`names` with repeats told apart: the first of each keeps its name, the next ones get
    ``-2``, ``-3`` ... (skipping any name the list already holds)."""
    taken = set(names)
    result: list[str] = []
    for name in names:
        unique, n = name, 1
        while unique in result or (unique != name and unique in taken):
            n += 1
            unique = f"{name}-{n}"
        result.append(unique)
    return result
