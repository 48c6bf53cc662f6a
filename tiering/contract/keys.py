"""Block keys and per-request context passed through every manager call.

Thread: any; keys and contexts are immutable values.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, NewType

OffloadKey = NewType("OffloadKey", bytes)
"""A block's identity: the block hash followed by a 4-byte big-endian KV-group index."""

_GROUP_IDX_BYTES = 4


def make_offload_key(block_hash: bytes, group_idx: int) -> OffloadKey:
    """Pack a block hash and a KV-group index into an `OffloadKey`.

    Raises:
        OverflowError: `group_idx` is negative or does not fit in 4 bytes.
    """
    return OffloadKey(bytes(block_hash) + group_idx.to_bytes(_GROUP_IDX_BYTES, "big", signed=False))


def get_offload_block_hash(key: OffloadKey) -> bytes:
    """Return the block hash part of `key` (everything but the last 4 bytes)."""
    return key[:-_GROUP_IDX_BYTES]


def get_offload_group_idx(key: OffloadKey) -> int:
    """Return the KV-group index stored in the last 4 bytes of `key`."""
    return int.from_bytes(key[-_GROUP_IDX_BYTES:], "big", signed=False)


@dataclass
class ReqContext:
    """What a manager knows about the request a call is made for.

    Attributes:
        req_id: the scheduler's request id; promotions are batched per `req_id`.
        kv_transfer_params: connector-specific parameters of the request, or None.
        tenant: who the request is for (vLLM: its ``cache_salt``), or None for the
            configured default tenant (see `tiering.cpu.tenants`).
        load_tiers: the indexes of the secondary tiers it may load from, or None: all
            (set by the manager from ``kv_load_tiers``: `tiering.engine.load_tiers`).
    """

    req_id: str
    kv_transfer_params: dict[str, Any] | None = None
    tenant: str | None = None
    load_tiers: frozenset[int] | None = None


class OffloadPolicy(enum.Enum):
    """How a request's blocks are offloaded."""

    BLOCK_LEVEL = "block_level"
    """Each block is stored as soon as it is full."""
    REQUEST_LEVEL = "request_level"
    """The request's blocks are stored together when the request finishes."""


@dataclass
class RequestOffloadingContext:
    """The manager's answer to `on_new_request`: how to offload this request."""

    policy: OffloadPolicy = OffloadPolicy.BLOCK_LEVEL
