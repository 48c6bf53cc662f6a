"""The CPU tier sized for vLLM's scheduler steps: the rows one step's stores take, and a
warning at start when the tier cannot carry two steps of transfers.

Thread: vLLM's scheduler thread, when the spec is built.
"""

from __future__ import annotations

import logging

from tiering.spec import TieringOffloadingSpec as EngineSpec

logger = logging.getLogger(__name__)

_SIZE_CHECKED: set[str] = set()  # engine ids whose CPU tier this process checked


def rows_for_one_step(max_num_batched_tokens: int, tokens_per_row: int, kv_groups: int = 1) -> int:
    """CPU rows one scheduler step of `max_num_batched_tokens` (tokens) can store, in rows
    of `tokens_per_row` tokens, a row per block of each of `kv_groups` KV-cache groups (a
    sliding-window group stores fewer: this is the bound): what promotions leave available
    for the GPU's stores (``store_reserve_rows``) unless the config says otherwise, at most
    half the tier."""
    return -(-max_num_batched_tokens // tokens_per_row) * kv_groups


def rows_for_two_steps(max_num_batched_tokens: int, tokens_per_row: int, kv_groups: int = 1) -> int:
    """The fewest CPU rows that carry vLLM's transfers under load: two scheduler steps of
    `max_num_batched_tokens` (tokens), in rows of `tokens_per_row` tokens. The rows a step
    stores stay in flight until its transfer finishes, while the next step's requests
    load their hits and promote their prefixes into rows of their own; a row in flight
    cannot be evicted, so a smaller tier refuses stores and promotions when prefills run."""
    return 2 * rows_for_one_step(max_num_batched_tokens, tokens_per_row, kv_groups)


def check_cpu_tier_size(engine: EngineSpec, max_num_batched_tokens: int, kv_groups: int = 1) -> None:
    """Warn (once per engine and process) when the CPU tier has fewer rows than
    `rows_for_two_steps`, naming ``cpu_bytes_to_use`` and the bytes that would fit."""
    if engine.instance_id in _SIZE_CHECKED:
        return
    _SIZE_CHECKED.add(engine.instance_id)
    needed = rows_for_two_steps(max_num_batched_tokens, engine.block_size, kv_groups)
    if engine.num_blocks < needed:
        logger.warning(
            "the CPU tier (cpu_bytes_to_use=%d: %d rows of %d tokens) is smaller than two scheduler steps of "
            "max_num_batched_tokens=%d (%d rows: one step's stores in flight while the next step's requests load "
            "and promote theirs); under load it will refuse stores and promotions (stores_refused, "
            "promotions_refused). cpu_bytes_to_use=%d or more fits them; see docs/vllm.md, sizing the CPU tier",
            engine.config.cpu_bytes_to_use,
            engine.num_blocks,
            engine.block_size,
            max_num_batched_tokens,
            needed,
            needed * engine.bytes_per_block,
        )
