"""The simulated serving engine around the real tiering engine.

A paged GPU KV cache of `gpu_blocks` blocks (CUDA when present, else host memory), kept as
an LRU prefix cache; the real `TieringOffloadingSpec` (manager, tiers, shared region) and
the real GPU<->CPU handlers move its blocks. One block id of a request is one offloaded
block and one GPU block.

Payloads are a deterministic function of the key and the layer (`Payloads`): each layer's
page is a slice of a fixed random pool, chosen by a 16-byte stamp of the key and layer that
is written on its first bytes. Verifying a loaded block compares every page, and a block
loaded under the wrong key, into the wrong layer, or with any corrupted byte, fails it.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict

import numpy as np
import torch

from tiering import (
    BlockStoreTier,
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    KVLayout,
    TieringConfig,
    TieringOffloadingSpec,
    TransferResult,
    canonicalize_kv_caches,
    make_offload_key,
)
from tiering.errors import describe

logger = logging.getLogger("tiering.bench")

_STAMP = 16


class Payloads:
    """The expected bytes of every block, per layer page: a page is the pool's slice at the
    first two bytes of its stamp, stamped on its first bytes; the stamp is the key's BLAKE2b
    (`stamps`) XOR a mask of the layer's, so that a page loaded under another key or into
    another layer differs."""

    def __init__(self, page_bytes: int, seed: int = 0):
        self.page_bytes = page_bytes
        pool = np.random.default_rng(seed).integers(0, 256, page_bytes + 65536, dtype=np.uint8)
        self._windows = np.lib.stride_tricks.sliding_window_view(pool, page_bytes)  # row i: pool[i : i + page]

    @staticmethod
    def stamps(keys: list[bytes]) -> np.ndarray:
        """The keys' digests: uint8, shape ``(len(keys), 16)``."""
        digests = b"".join(hashlib.blake2b(key, digest_size=_STAMP).digest() for key in keys)
        return np.frombuffer(digests, dtype=np.uint8).reshape(len(keys), _STAMP)

    def pages(self, stamps: np.ndarray, layer: int) -> np.ndarray:
        """The pages of the keys of `stamps` in `layer`: uint8, shape ``(len(stamps),
        page_bytes)``, in one gather (a step of Python per page took a fifth of a replay)."""
        mask = np.frombuffer(hashlib.blake2b(layer.to_bytes(4, "big"), digest_size=_STAMP).digest(), dtype=np.uint8)
        stamped = stamps ^ mask
        pages = self._windows[stamped[:, 0].astype(np.intp) << 8 | stamped[:, 1]]
        width = min(_STAMP, self.page_bytes)
        pages[:, :width] = stamped[:, :width]
        return pages


class SimulatedEngine:
    """A GPU prefix cache over real KV tensors, offloading through a real spec."""

    def __init__(
        self,
        config: TieringConfig,
        layout: KVLayout,
        gpu_blocks: int,
        instance_id: str,
        seed: int = 0,
        prefix_cache: bool = True,
    ):
        """
        Args:
            prefix_cache: the GPU blocks serve later requests' prefixes (False: every block
                of a request comes from the engine or is computed).

        Raises:
            ValueError, OSError, ...: as `TieringOffloadingSpec` and `get_manager`.
        """
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.spec = TieringOffloadingSpec(config, layout, instance_id)
        try:
            self.manager = self.spec.get_manager()
            page = layout.kv_bytes_per_token_per_layer // layout.world_size * layout.gpu_block_size
            self.layers = [
                torch.zeros((gpu_blocks, page), dtype=torch.int8, device=self.device) for _ in range(layout.num_layers)
            ]
            self.handlers = self.spec.create_handlers(canonicalize_kv_caches(self.layers, gpu_blocks))
        except BaseException:
            self.spec.shutdown()
            raise
        self.payloads = Payloads(page, seed)
        self.gpu_blocks = gpu_blocks
        self.prefix_cache = prefix_cache
        self._slots: OrderedDict[bytes, int] = OrderedDict()  # cached key -> GPU block, LRU order
        self._free = list(range(gpu_blocks - 1, -1, -1))
        self._job_ids = iter(range(1 << 62))
        self.transfers: list[TransferResult] = []

    # -- the GPU prefix cache --------------------------------------------------------------

    def gpu_prefix(self, keys: list[bytes]) -> int:
        """How many leading `keys` the GPU cache holds (they become the most recent); 0
        without a prefix cache."""
        if not self.prefix_cache:
            return 0
        count = 0
        for key in keys:
            if key not in self._slots:
                break
            self._slots.move_to_end(key)
            count += 1
        return count

    def allocate(self, keys: list[bytes], keep: set[bytes]) -> list[int] | None:
        """GPU blocks for `keys`, evicting least recent blocks not in `keep`; None if the
        cache cannot fit them. A key already cached (outside the request's leading prefix)
        gives its block back first: it is about to be rewritten."""
        self.forget(keys)
        while len(self._free) < len(keys):
            victim = next((key for key in self._slots if key not in keep), None)
            if victim is None:
                return None
            self._free.append(self._slots.pop(victim))
        slots = [self._free.pop() for _ in keys]
        self._slots.update(zip(keys, slots, strict=True))
        return slots

    def slots(self, keys: list[bytes]) -> list[int]:
        """The GPU blocks holding `keys` (each allocated and not forgotten since)."""
        return [self._slots[key] for key in keys]

    # -- data movement ---------------------------------------------------------------------

    def compute(self, keys: list[bytes], slots: list[int]) -> None:
        """Write the blocks' payloads into their GPU blocks, as a prefill would. On a CPU
        device through numpy, in this thread: a torch copy would fan out to its intra-op
        threads for every call (each replay step makes some), which on a busy 2-core host
        made a full-trace replay 3x slower (225 s against 67 s with one thread)."""
        stamps = self.payloads.stamps(keys)
        for layer, pages in enumerate(self.layers):
            data = self.payloads.pages(stamps, layer)
            if self.device.type == "cpu":
                pages.numpy()[slots] = data.view(np.int8)
            else:
                rows = torch.as_tensor(slots, device=self.device)
                pages[rows] = torch.from_numpy(data).view(torch.int8).to(self.device)

    def store(self, slots: list[int], cpu_block_ids: np.ndarray) -> bool:
        spec = (GPULoadStoreSpec(slots, [len(slots)], [0]), CPULoadStoreSpec(cpu_block_ids))
        return self._transfer(self.handlers.gpu_to_cpu_handler, spec)

    def load(self, cpu_block_ids: np.ndarray, slots: list[int]) -> bool:
        spec = (CPULoadStoreSpec(cpu_block_ids), GPULoadStoreSpec(slots, [len(slots)], [0]))
        return self._transfer(self.handlers.cpu_to_gpu_handler, spec)

    def _transfer(self, handler, spec) -> bool:
        job_id = next(self._job_ids)
        if not handler.transfer_async(job_id, spec):
            return False
        handler.wait([job_id])
        results = handler.get_finished()
        self.transfers.extend(results)
        return all(result.success for result in results)

    def verify(self, keys: list[bytes], slots: list[int]) -> int:
        """Blocks among `keys` whose GPU bytes differ from their payload."""
        wrong, stamps = np.zeros(len(keys), dtype=bool), self.payloads.stamps(keys)
        for layer, pages in enumerate(self.layers):
            loaded = pages[slots].cpu().numpy().view(np.uint8)
            wrong |= (loaded != self.payloads.pages(stamps, layer)).any(axis=1)
        return int(wrong.sum())

    def forget(self, keys: list[bytes]) -> None:
        """Drop blocks from the GPU cache (a failed load leaves them unusable)."""
        for key in keys:
            slot = self._slots.pop(key, None)
            if slot is not None:
                self._free.append(slot)

    def shutdown(self) -> None:
        self.spec.shutdown()

    def capacity_blocks(self, gpu_blocks: int) -> int | None:
        """Blocks the GPU prefix cache (`gpu_blocks`), the CPU tier and the secondary tiers
        hold together at most (their sum: write-through tiers hold copies, so the hierarchy
        holds fewer distinct blocks); None if a tier has no capacity limit or is not a
        block-store tier."""
        total = gpu_blocks + self.spec.num_blocks
        key = make_offload_key(bytes(8), 0)  # the load generator's keys: 8-byte ids, group 0
        for tier in self.manager.secondary_tiers:
            blocks = tier.capacity_blocks(key)
            if blocks is None:
                return None
            total += blocks
        return total

    def remove_namespaces(self) -> None:
        """Delete what the run stored in its block-store tiers (file, s3, ...: the run's own
        namespace only). A tier that cannot is logged, and its objects stay."""
        for name, tier in zip(self.manager.tier_names, self.manager.secondary_tiers, strict=True):
            if isinstance(tier, BlockStoreTier):
                try:
                    tier.remove_namespace()
                except Exception as exc:
                    logger.warning("tier %s: could not remove the run's objects: %s", name, describe(exc))
