"""Where a request's time to first token went: the client's times joined with the engine's
request log (`tiering.engine.timeline`, one JSON line per request vLLM finished).

For a request that loaded blocks from the engine, from its arrival (all in seconds):

- ``to_lookup_s``: until the scheduler first looked its prefix up (queueing, HTTP,
  tokenization);
- ``to_loadable_s`` and ``steps_to_load``: from that lookup until every block was in the
  CPU tier and the load was submitted (promotions from secondary tiers, deferred steps);
- ``load_s`` and ``steps_loading``: the load, from submission until vLLM's worker
  reported it done (the copy, and the step it waits for); ``rows_wait_s``: the part of it
  the worker waited for rows still being promoted (hits answered in the step they were
  found, behind the engine's connector; 0 otherwise), and ``blocks_pending``: how many;
- ``after_load_s``: from then to the first token (the step that computes the rest of
  the prompt, and the scheduling before it);
- ``promotion_s``: per tier, from the first lookup to the promotion's report, and
  ``promoted_blocks``: the blocks promoted for it, all tiers together;
- ``disk_floor_s``: for a configuration with a file tier, the fastest raw read of the bytes
  it promoted on the same disk (`tiering.benchmarks.serve.floor`), None without promotions.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

_INDEX = re.compile(r"bench-(\d+)")
FIELDS = (
    "to_lookup_s",
    "to_loadable_s",
    "steps_to_load",
    "load_s",
    "steps_loading",
    "rows_wait_s",
    "blocks_pending",
    "after_load_s",
)


def read_request_log(path: Path) -> dict[int, dict[str, Any]]:
    """The engine's lines by the client's request index (from ``bench-<index>`` in vLLM's
    request id); empty if there is no log. Lines of other requests are left out."""
    if not path.exists():
        return {}
    entries = {}
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        match = _INDEX.search(entry["req_id"])
        if match:
            entries[int(match.group(1))] = entry
    return entries


def breakdown(outcome: dict[str, Any], entry: dict[str, Any] | None) -> dict[str, Any] | None:
    """The parts of `outcome`'s TTFT (see the module docstring), or None when the request
    failed, or loaded nothing from the engine."""
    if entry is None or outcome["ttft_s"] is None or entry["load_completed"] is None:
        return None
    due = outcome["due_monotonic"]
    return {
        "to_lookup_s": entry["first_lookup"] - due,
        "to_loadable_s": entry["load_prepared"] - entry["first_lookup"],
        "steps_to_load": entry["steps_to_load"],
        "load_s": entry["load_completed"] - entry["load_prepared"],
        "steps_loading": entry["steps_loading"],
        "rows_wait_s": entry.get("rows_wait_s") or 0.0,
        "blocks_pending": entry.get("blocks_pending", 0),
        "after_load_s": due + outcome["ttft_s"] - entry["load_completed"],
        "blocks_loaded": entry["blocks_loaded"],
        "promotion_s": entry["promotions"],
        "promoted_blocks": sum(entry.get("promoted_blocks", {}).values()),
        "disk_floor_s": None,
    }
