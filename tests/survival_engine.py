"""An engine in a process of its own for the crash-survival tests (`tests.test_survive_crash`):
a scheduler with a crash-surviving CPU tier and its workers (one per rank, in the same process),
whose "GPU" KV caches are CPU tensors.
It reads one JSON command per line on stdin and answers one JSON line on stdout once the
command is done, so that the test can kill it (SIGKILL) at exactly the point it chose.

Commands: ``{"store": [ids], "commit": bool}`` copies the blocks of `ids` (block ``i`` holds GPU
block ``i % GPU_BLOCKS``) into the rows the manager reserves and, with `commit`, completes the
store; ``{"tear": id}`` reserves a row and writes half of it, as a copy cut short; ``{"seal":
true}`` waits until every committed row is sealed; ``{"cascade": true}`` waits until the file
tier (with a ``ROOT_DIR``) holds every block stored so far; ``{"promote": [ids]}`` looks the
blocks up, which starts their promotions from the file tier, and answers without waiting for
them; ``{"stop": true}`` stops gracefully. Run as ``python -m tests.survival_engine MODEL
CPU_BYTES INSTANCE WORKERS [ROOT_DIR]``."""

import functools
import json
import sys

import numpy as np
import torch

from tests.helpers import keys
from tiering import (
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    KVLayout,
    ReqContext,
    TieringOffloadingSpec,
    canonicalize_kv_caches,
    parse_config,
)

LAYERS, TOKEN_BYTES, GPU_BLOCK, GPU_BLOCKS = 2, 64, 4, 64
ROW_BYTES = LAYERS * TOKEN_BYTES * GPU_BLOCK


def layout(model: str, workers: int = 1) -> KVLayout:
    """`model`'s layout, each row split between `workers` tensor-parallel ranks."""
    return KVLayout(
        model, num_layers=LAYERS, kv_bytes_per_token_per_layer=TOKEN_BYTES, gpu_block_size=GPU_BLOCK, world_size=workers
    )


def config(cpu_bytes: int, keep_on_stop: bool = True, weights: str | None = None, root_dir: str | None = None):
    keep = str(keep_on_stop).lower()
    text = f"cpu_bytes_to_use: {cpu_bytes}\ncpu_tier: {{survive_crash: true, keep_on_stop: {keep}}}\n"
    text += f"weight_version: {weights}\n" if weights else ""
    return parse_config(text + (f"secondary_tiers: [{{type: file, root_dir: {root_dir}}}]\n" if root_dir else ""))


@functools.cache
def gpu_caches(rank: int = 0, workers: int = 1) -> list[torch.Tensor]:
    """Rank `rank`'s KV caches (its share of every layer), the same in every process."""
    generator = torch.Generator().manual_seed(rank)
    shape = (GPU_BLOCKS, GPU_BLOCK * TOKEN_BYTES // workers)
    return [torch.randint(-128, 127, shape, dtype=torch.int8, generator=generator) for _ in range(LAYERS)]


def expected_row(block: int, workers: int = 1) -> bytes:
    """The bytes of block `block`'s row: each rank's slot in turn, a slot each layer's page of
    the rank's GPU block."""
    pages = (layer[block % GPU_BLOCKS] for rank in range(workers) for layer in gpu_caches(rank, workers))
    return b"".join(page.numpy().tobytes() for page in pages)


def block_of(key: bytes) -> int:
    """The block number of a key of `tests.helpers.keys`."""
    return int.from_bytes(key[:8], "big")


def main(model: str, cpu_bytes: int, instance: str, workers: int, root_dir: str | None) -> None:
    spec = TieringOffloadingSpec(config(cpu_bytes, root_dir=root_dir), layout(model, workers), instance)
    manager = spec.get_manager()
    ranks = [
        spec.create_handlers(canonicalize_kv_caches(gpu_caches(rank, workers), GPU_BLOCKS), rank)
        for rank in range(workers)
    ]
    rows = np.asarray(manager.primary_tier.get_kv_memoryview())
    ctx, job = ReqContext("survival"), 0
    print(json.dumps({"started": manager.primary_tier.get_stats()["counters"]["blocks_adopted"]}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if "store" in command:
            out = manager.prepare_store(keys(*command["store"]), ctx)
            gpu_ids = [block_of(key) % GPU_BLOCKS for key in out.keys_to_store]
            spec_pair = GPULoadStoreSpec(gpu_ids, [len(gpu_ids)], [0]), CPULoadStoreSpec(out.store_spec.block_ids)
            for handlers in ranks:  # each rank's slot of the rows; vLLM completes a store once all did
                job += 1
                assert handlers.gpu_to_cpu_handler.transfer_async(job, spec_pair)
                handlers.gpu_to_cpu_handler.wait([job])
            if command["commit"]:
                manager.complete_store(out.keys_to_store, ctx)
            reply = {"stored": list(map(block_of, out.keys_to_store)), "evicted": list(map(block_of, out.evicted_keys))}
        elif "tear" in command:
            out = manager.prepare_store(keys(command["tear"]), ctx)
            rows[out.store_spec.block_ids[0], : ROW_BYTES // 2] = 7
            reply = {"torn": command["tear"]}
        elif "cascade" in command:
            reply = {"cascaded": all(tier.drain(30) for tier in manager.secondary_tiers)}
            manager.on_schedule_end()  # the cascades' results release their rows
        elif "promote" in command:
            reply = {"found": [manager.lookup(key, ctx) for key in keys(*command["promote"])]}
        elif "seal" in command:
            reply = {"sealed": manager.primary_tier.drain_seals(30)}
        else:
            spec.shutdown()
            reply = {"stopped": True}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5] if len(sys.argv) > 5 else None)
