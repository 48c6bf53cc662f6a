"""The engine's identity under vLLM: its `KVLayout` from vLLM's ``OffloadingConfig``, from the
``VllmConfig`` where it is current (the model's revision, the prefix-hash algorithm), and from
the KV-cache groups' specs where the engine's connector hands them over (each group's kind
and sliding window; `group_specs`).

What it covers, beside what vLLM's own file tier names its folders by, is tabled in
docs/sharing.md. One point is stricter than vLLM's: the TP, PP, PCP and DCP sizes are part
of the identity even where vLLM calls its layout parallelism-agnostic, since a CPU row here
is every worker's slot in rank order, and those slots split a block by the parallel layout.

Thread: the thread that builds the spec (vLLM's scheduler, or a worker).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from tiering.contract.identity import KVGroupShape, ParallelShape
from tiering.spec import KVLayout

_GROUP_SPECS: ContextVar[dict[int, tuple[str, int | None]] | None] = ContextVar("tiering_group_specs", default=None)


@contextmanager
def group_specs(kv_cache_config: Any) -> Iterator[None]:
    """While the block runs, specs built in it (in this thread or task: a context variable)
    know each KV-cache group's kind (vLLM's spec class names) and sliding window in tokens
    from `kv_cache_config` (vLLM's ``KVCacheConfig``, or None: nothing known), which vLLM's
    offloading config leaves out: the engine's connector builds its spec inside it. Raises
    nothing of its own."""
    kinds: dict[int, tuple[str, int | None]] = {}
    for index, group in enumerate(getattr(kv_cache_config, "kv_cache_groups", None) or ()):
        spec = group.kv_cache_spec
        per_layer = getattr(spec, "kv_cache_specs", None)  # vLLM's UniformTypeKVCacheSpecs
        specs = list(per_layer.values()) if per_layer else [spec]
        kind = "+".join(sorted({type(one).__name__ for one in specs}))
        windows = {getattr(one, "sliding_window", None) or getattr(one, "attention_chunk_size", None) for one in specs}
        kinds[index] = (kind, windows.pop() if len(windows) == 1 else None)
    token = _GROUP_SPECS.set(kinds)
    try:
        yield
    finally:
        _GROUP_SPECS.reset(token)


def vllm_layout(config: Any, vllm_config: Any, kv_bytes_per_token: int, tokens_per_block: int) -> KVLayout:
    """The `KVLayout` of the engine vLLM's `config` (``OffloadingConfig``) describes, with what
    `vllm_config` (``VllmConfig``, or None where none is current: the revision and hash
    algorithm are then None) adds: a KV of `kv_bytes_per_token` bytes per token (every
    worker's share, all layers), GPU blocks of `tokens_per_block` tokens. Groups' kinds and
    windows come from an enclosing `group_specs`, else None.

    Raises:
        KeyError: a canonical layout with a ``kv_cache_layout`` vLLM's canonical format
            does not know (as vLLM's own ``canonical_format_id`` raises).
    """
    parallel = config.parallel
    kinds = _GROUP_SPECS.get() or {}
    groups = tuple(
        KVGroupShape(tuple(group.layer_names), group.tokens_per_block, *kinds.get(group.group_id, (None, None)))
        for group in config.groups
    )
    canonical = None
    if getattr(config, "canonical_layout", False) and config.kv_cache_layout is not None:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import canonical_format_id

        canonical = canonical_format_id(config.kv_cache_layout)
    model_config = getattr(vllm_config, "model_config", None)
    cache_config = getattr(vllm_config, "cache_config", None)
    hash_algorithm = getattr(cache_config, "prefix_caching_hash_algo", None)
    return KVLayout(
        model=config.model.name,
        num_layers=1,
        kv_bytes_per_token_per_layer=kv_bytes_per_token,
        gpu_block_size=tokens_per_block,
        dtype=str(config.model.dtype),
        world_size=max(1, parallel.world_size),
        kv_groups=len(config.groups),
        revision=getattr(model_config, "revision", None),
        tokens_per_hash=config.cache.tokens_per_hash,
        groups=groups,
        parallel=ParallelShape(
            parallel.tp_size,
            parallel.pp_size,
            parallel.pcp_size,
            parallel.dcp_size,
            canonical,
            bool(getattr(config, "replicated_layout", False)),
        ),
        kv_cache_layout=getattr(config, "kv_cache_layout", None),
        hash_algorithm=None if hash_algorithm is None else str(hash_algorithm),
    )
