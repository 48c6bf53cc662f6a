"""Canonical KV caches: every KV tensor seen as ``(num_blocks, page_size_bytes)`` int8 pages.

Attention backends lay out their KV caches differently; the transfer handlers only need
one view: per tensor, one page of bytes per GPU block. `canonicalize_kv_caches` builds it,
zero copy, from tensors whose leading dimension is ``num_blocks`` or, FlashAttention style,
``(2, num_blocks, ...)`` (split into a K and a V tensor).

Thread: the worker process's, at start-up (built once, then only read by the handlers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class CanonicalKVCacheTensor:
    """A KV tensor as pages: ``tensor`` is int8 of shape ``(num_blocks, page_size_bytes)``.

    ``page_size_bytes`` is the (possibly padded) bytes of one block of this tensor.
    """

    tensor: torch.Tensor
    page_size_bytes: int


@dataclass
class CanonicalKVCacheRef:
    """A layer's (or group of layers') use of tensor ``tensor_idx``; ``page_size_bytes``
    is the layer's un-padded page size."""

    tensor_idx: int
    page_size_bytes: int


@dataclass
class CanonicalKVCaches:
    """Unique page tensors, and per KV-cache group the references of its layers to them."""

    tensors: list[CanonicalKVCacheTensor]
    group_data_refs: list[list[CanonicalKVCacheRef]]


def _as_pages(tensor: torch.Tensor, num_blocks: int) -> torch.Tensor:
    if not tensor.is_contiguous():
        raise ValueError(f"a KV tensor of shape {tuple(tensor.shape)} is not contiguous; pages need a zero-copy view")
    return tensor.view(torch.int8).view(num_blocks, -1)


def canonicalize_kv_caches(
    layer_caches: Sequence[torch.Tensor],
    num_blocks: int,
    groups: Sequence[Sequence[int]] | None = None,
) -> CanonicalKVCaches:
    """Page views of the KV tensors of each layer, sharing storage with them.

    Args:
        layer_caches: one tensor per layer, shaped ``(num_blocks, ...)`` or
            ``(2, num_blocks, ...)`` (K and V, FlashAttention); layers may share a tensor.
        num_blocks: GPU blocks per tensor.
        groups: layer indices of each KV-cache group; None puts every layer in one group.

    Returns:
        One `CanonicalKVCacheTensor` per distinct page tensor (K and V count as two), and
        per group the references of its layers, in layer order.

    Raises:
        ValueError: a tensor has neither layout, or is not contiguous.
    """
    tensors: list[CanonicalKVCacheTensor] = []
    index_of: dict[tuple[int, int], int] = {}  # (data pointer, bytes) -> tensor index
    layer_refs: list[list[CanonicalKVCacheRef]] = []
    for layer, cache in enumerate(layer_caches):
        if cache.dim() >= 2 and cache.shape[0] == num_blocks:
            parts = [cache]
        elif cache.dim() >= 3 and cache.shape[0] == 2 and cache.shape[1] == num_blocks:
            parts = [cache[0], cache[1]]
        else:
            raise ValueError(
                f"layer {layer}: KV tensor of shape {tuple(cache.shape)} has neither (num_blocks, ...) "
                f"nor (2, num_blocks, ...) layout for num_blocks={num_blocks}"
            )
        refs = []
        for part in parts:
            pages = _as_pages(part, num_blocks)
            identity = (pages.data_ptr(), pages.numel())
            if identity not in index_of:
                index_of[identity] = len(tensors)
                tensors.append(CanonicalKVCacheTensor(pages, pages.shape[1]))
            refs.append(CanonicalKVCacheRef(index_of[identity], pages.shape[1]))
        layer_refs.append(refs)
    groups = groups if groups is not None else [range(len(layer_caches))]
    return CanonicalKVCaches(tensors, [[ref for layer in group for ref in layer_refs[layer]] for group in groups])
