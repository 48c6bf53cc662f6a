"""Which secondary tiers a request may load from: ``kv_load_tiers`` in its
``kv_transfer_params`` (vLLM's key), for example::

    {"kv_load_tiers": [{"medium": "storage", "locality": "local"}, {"owner": "s3"}]}

An entry names a `medium`, a `locality` and an `owner` (a tier's name), any of them; it
matches a tier when every key it gives does (medium and locality in any case). A tier is
allowed when some entry matches it. ``[]`` allows none; without the key every tier is
allowed. The CPU tier always serves the request, as in vLLM (a block promoted into it is a
CPU block). A value that does not parse, or one over `MAX_ENTRIES` entries or
`MAX_VALUE_CHARS` a value, is ignored with a log line: a client's mistake never fails its
request, nor costs the scheduler more than a few microseconds.

Thread: the scheduler thread.
"""

from __future__ import annotations

import logging
import reprlib
from collections.abc import Sequence
from typing import Any

from tiering.contract.mediums import LOCAL, REMOTE, STORAGE, CPULoadStoreSpec
from tiering.stats import RareLog
from tiering.tiers.base import SecondaryTierManager

logger = logging.getLogger(__name__)

LOAD_TIERS_KEY = "kv_load_tiers"
MAX_ENTRIES = 16
"""Entries of a request's ``kv_load_tiers`` at most."""
MAX_VALUE_CHARS = 64
"""Characters of an entry's value at most."""
_KEYS = ("medium", "locality", "owner")
MEDIUMS = (CPULoadStoreSpec.medium(), STORAGE)
"""The mediums a tier may declare: those of vLLM's ``Medium`` (its KV events carry no other)."""
LOCALITIES = (LOCAL, REMOTE)
"""The localities a tier may declare: those of vLLM's ``Locality``."""

Place = tuple[str, str, str]
"""(medium, locality, owner) of a secondary tier."""


def tier_places(tiers: Sequence[SecondaryTierManager], names: Sequence[str]) -> list[Place]:
    """(medium, locality, owner) of each of `tiers` (named `names`), as its KV events and a
    request's ``kv_load_tiers`` name it; a tier that does not subclass `SecondaryTierManager`
    takes its defaults (`STORAGE`, `LOCAL`).

    Raises:
        ValueError: a tier declares a medium not in `MEDIUMS` or a locality not in
            `LOCALITIES` (any case); names the tier.
    """
    places = []
    for tier, name in zip(tiers, names, strict=True):
        medium = str(getattr(tier, "medium", STORAGE)).upper()
        locality = str(getattr(tier, "locality", LOCAL)).upper()
        if medium not in MEDIUMS or locality not in LOCALITIES:
            raise ValueError(
                f"tier {name}: medium {medium!r} and locality {locality!r}; "
                f"expected a medium of {', '.join(MEDIUMS)} and a locality of {', '.join(LOCALITIES)}"
            )
        places.append((medium, locality, name))
    return places


def allowed_tiers(req_context: Any, places: Sequence[Place], log: RareLog | None = None) -> frozenset[int] | None:
    """The indexes of the tiers at `places` (`tier_places`) the request of `req_context` may
    load from, or None: every one (no ``kv_load_tiers``, or one that does not parse: counted
    and logged by `log`, rarely; None: not logged). Never raises."""
    params = getattr(req_context, "kv_transfer_params", None)
    if not isinstance(params, dict) or LOAD_TIERS_KEY not in params:
        return None
    entries = params[LOAD_TIERS_KEY]
    try:
        matchers = [_matcher(entry) for entry in _bounded(entries)]
    except ValueError as exc:
        if log is not None:
            request = getattr(req_context, "req_id", "?")
            log.warning(logger, "request %.64s: %s ignored: %s", request, LOAD_TIERS_KEY, exc)
        return None
    return frozenset(
        idx
        for idx, tier in enumerate(places)
        if any(
            all(want is None or want == have for want, have in zip(matcher, tier, strict=True)) for matcher in matchers
        )
    )


def _bounded(entries: Any) -> list[Any]:
    if not isinstance(entries, list) or len(entries) > MAX_ENTRIES:
        raise ValueError(f"expected a list of at most {MAX_ENTRIES} entries, got {reprlib.repr(entries)}")
    return entries


def _matcher(entry: Any) -> tuple[str | None, str | None, str | None]:
    """(medium, locality, owner) an entry asks for (None: any)."""
    if not isinstance(entry, dict) or len(entry) > len(_KEYS) or not set(entry) <= set(_KEYS):
        raise ValueError(f"expected entries of {', '.join(_KEYS)}, got {reprlib.repr(entry)}")
    values = [entry.get(key) for key in _KEYS]
    for value in values:
        if value is not None and (not isinstance(value, str) or len(value) > MAX_VALUE_CHARS):
            raise ValueError(f"expected names of at most {MAX_VALUE_CHARS} characters, got {reprlib.repr(value)}")
    medium, locality, owner = values
    return (None if medium is None else medium.upper(), None if locality is None else locality.upper(), owner)
