"""`EngineIdentity`: everything that shapes a block's bytes or what they mean.

Two engines may read each other's blocks only if their identities are equal and they run the
same weights: the identity's digest, with the weights' version, names the tier's namespace
(`namespace`) and is written into every object's header, so a block is never offered to an
engine that would read its bytes another way (another parallel split, memory layout, dtype,
model revision, group of layers, format) or that computes with other weights (another
declared version, or a reset that declared none).

An identity is built once per engine (`tiering.spec.KVLayout.identity`, from the engine's
settings and, under vLLM, from its ``OffloadingConfig`` and ``VllmConfig``); its `manifest`
is the same fields in plain words, kept beside each namespace for people and tools.

Thread: any; immutable values and pure functions.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

ROW_FORMAT = 1
"""The CPU row's layout: each worker's slot in rank order, each slot its layers' pages in the
order of the KV caches handed to the worker. Bump it when that changes."""
OBJECT_FORMAT = 3
"""The stored object's layout (`tiering.tiers.object_format`). Bump it when that changes
(2: headers carry their own CRC32C; 3: XXH3-64 of the payload and of the header)."""
NAMESPACE_BYTES = 16


@dataclass(frozen=True)
class KVGroupShape:
    """One KV-cache group as the identity sees it.

    Attributes:
        layer_names: the group's layers, in order.
        tokens_per_block: tokens per GPU block of the group.
        kind: the group's attention kind (vLLM's spec class name: ``FullAttentionSpec``,
            ``SlidingWindowSpec`` ...), or None where the serving engine does not say.
        sliding_window: the window in tokens, or None (full attention, or not known).
    """

    layer_names: tuple[str, ...]
    tokens_per_block: int
    kind: str | None = None
    sliding_window: int | None = None


@dataclass(frozen=True)
class ParallelShape:
    """How the KV of a block is split between workers (a CPU row holds every worker's slot,
    so the split shapes the row, not a worker's rank).

    Attributes:
        tensor, pipeline, prefill_context, decode_context: the TP, PP, PCP and DCP sizes.
        canonical_format: the canonical page format's id (vLLM's ``canonical_format_id``)
            where the serving engine hands its KV as canonical pages, else None.
        replicated: every worker's bytes are the same (vLLM's replicated layout).
    """

    tensor: int = 1
    pipeline: int = 1
    prefill_context: int = 1
    decode_context: int = 1
    canonical_format: str | None = None
    replicated: bool = False


@dataclass(frozen=True)
class EngineIdentity:
    """Attributes:
    model: the model's name (a path or hub id).
    model_revision: the model's revision where the serving engine knows it, else None.
    model_version: the operator's name for weights that change under one model name (a
        fine-tune, an RL step; the ``model_version`` setting), else None.
    kv_dtype: the KV dtype as stored (``bfloat16``, ``fp8_e4m3`` ...).
    tokens_per_block: tokens per offloaded block (a CPU row).
    tokens_per_hash: tokens per block hash (the prefix hash's step).
    bytes_per_block: bytes of one CPU row, every worker's slot.
    groups: the KV-cache groups; empty where only their number is known (`group_count`).
    group_count: how many KV-cache groups the model has.
    parallel: the split between workers.
    kv_cache_layout: the serving engine's memory layout of its KV cache (vLLM's
        ``kv_cache_layout``: ``NHD``, ``HND``, ``LBHNC`` ...), or None where it has one only.
    hash_algorithm: the serving engine's prefix-hash algorithm, or None (the engine's default).
    row_format, object_format: this engine's `ROW_FORMAT` and `OBJECT_FORMAT`.
    """

    model: str
    kv_dtype: str
    tokens_per_block: int
    bytes_per_block: int
    tokens_per_hash: int | None = None
    model_revision: str | None = None
    model_version: str | None = None
    groups: tuple[KVGroupShape, ...] = ()
    group_count: int = 1
    parallel: ParallelShape = field(default_factory=ParallelShape)
    kv_cache_layout: str | None = None
    hash_algorithm: str | None = None
    row_format: int = ROW_FORMAT
    object_format: int = OBJECT_FORMAT

    def manifest(self) -> dict[str, Any]:
        """The identity in plain words: a JSON-ready dict of every field (groups and parallel
        split as nested dicts, layer names as lists). Any thread."""
        return asdict(self)

    def digest(self) -> bytes:
        """16 bytes naming this identity: equal identities, equal digests (BLAKE2b of the
        manifest as canonical JSON). Any thread; raises nothing."""
        text = json.dumps(self.manifest(), sort_keys=True, separators=(",", ":"))
        return hashlib.blake2b(text.encode(), digest_size=NAMESPACE_BYTES, person=b"kv-identity").digest()


CHECKPOINT = ""
"""The weights' version of an engine that declared none: the checkpoint's weights it loaded."""
MAX_WEIGHT_VERSION_CHARS = 256
"""The longest weight version a deployment may declare."""
WEIGHT_VERSION = re.compile(rf"[\x21-\x7e]{{1,{MAX_WEIGHT_VERSION_CHARS}}}")
"""What a declared weight version is: printable ASCII without blanks (a label in logs and listings)."""


def check_weight_version(version: str | None) -> None:
    """Refuse a declared weight version that is not `WEIGHT_VERSION` (None passes: none
    declared). Any thread; pure.

    Raises:
        ValueError: says what a version is.
    """
    if version is not None and not (isinstance(version, str) and WEIGHT_VERSION.fullmatch(version)):
        raise ValueError(
            f"a weight version is 1 to {MAX_WEIGHT_VERSION_CHARS} printable ASCII characters without blanks; "
            f"got {version!r:.60}"
        )


def namespace(identity_digest: bytes, weights: str) -> bytes:
    """16 bytes naming the namespace of the blocks computed with weights `weights` (a declared
    weight version, `CHECKPOINT`, or a label no other engine can know) by engines of the
    identity whose `EngineIdentity.digest` is `identity_digest`: a function of the two alone,
    so replicas on one version share it however they got there, and replicas on different
    versions never do. It names a lasting tier's namespace and is written into each of its
    objects' headers. Any thread; raises nothing."""
    return hashlib.blake2b(
        weights.encode(), key=identity_digest, digest_size=NAMESPACE_BYTES, person=b"kv-weights"
    ).digest()
