"""`TieringOffloadingSpec`: builds the whole engine from a config and a KV layout.

Sizing: an offloaded block is ``block_size`` tokens of KV for every layer; its bytes are
``kv_bytes_per_token * block_size``, split evenly between the ``world_size`` workers (each
fills its slot of every CPU row). The primary tier has ``cpu_bytes_to_use // bytes_per_block``
rows. The engine's identity (`tiering.contract.identity`: model, revision and version, KV
dtype, tokens per block and per hash, KV-cache groups, parallel split, memory layout, formats)
names the lasting tiers' namespaces, so engines that would read a block's bytes another way
never read these blocks.

Thread: the thread that starts the engine (`get_manager`, `shutdown`); workers call
`create_handlers` on their own.
"""

from __future__ import annotations

import atexit
import errno
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from tiering.config import TieringConfig
from tiering.contract.identity import CHECKPOINT, EngineIdentity, KVGroupShape, ParallelShape
from tiering.contract.mediums import CPULoadStoreSpec, GPULoadStoreSpec
from tiering.cpu.primary import CPUPrimaryTierOffloadingManager
from tiering.cpu.row_records import Survival
from tiering.cpu.shared_region import SharedOffloadRegion
from tiering.engine.admission import AdmissionConfig
from tiering.engine.manager import TieringOffloadingManager
from tiering.errors import ConfigError, TierConfigError, describe, describe_bind_error
from tiering.tiers.base import SecondaryTierManager
from tiering.tiers.context import TierContext
from tiering.tiers.factory import SecondaryTierFactory
from tiering.tiers.runtime import AsyncRuntime

logger = logging.getLogger(__name__)

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8": 1, "int8": 1}
MODEL_PRESETS = {  # layers, KV heads, head dimension[, KV-cache groups under vLLM's hybrid cache]
    "llama-3.1-8b": (32, 8, 128),
    "llama-3.1-70b": (80, 8, 128),
    "mistral-7b": (32, 8, 128),
    "qwen2.5-7b": (28, 4, 128),
    "gpt-oss-20b": (24, 8, 64, 2),  # sliding-window and full attention, alternating
    "gpt-oss-120b": (36, 8, 64, 2),
}


@dataclass(frozen=True)
class KVLayout:
    """The KV cache of one model on one engine.

    Every field but the sizes' is part of the engine's identity (`identity`).

    Attributes:
        model: the model's name.
        num_layers: attention layers.
        kv_bytes_per_token_per_layer: K and V of one token in one layer, all heads, bytes.
        gpu_block_size: tokens per GPU (paged-attention) block.
        dtype: KV dtype name, as stored.
        world_size: workers sharing each CPU row (each fills its slot).
        kv_groups: KV-cache groups (vLLM's hybrid cache: each group's layers, of one kind,
            laid over the same tensors); a block of a prefix takes one row per group, and
            `num_layers` are one group's.
        revision: the model's revision, or None.
        tokens_per_hash: tokens per block hash, or None (the GPU block size).
        groups: each KV-cache group's shape (layer names, block size, kind, window), or
            empty where only their number (`kv_groups`) is known.
        parallel: the split between workers, or None: `world_size` tensor-parallel workers.
        kv_cache_layout: the serving engine's KV memory layout, or None.
        hash_algorithm: the serving engine's prefix-hash algorithm, or None.
    """

    model: str
    num_layers: int
    kv_bytes_per_token_per_layer: int
    gpu_block_size: int = 16
    dtype: str = "bfloat16"
    world_size: int = 1
    kv_groups: int = 1
    revision: str | None = None
    tokens_per_hash: int | None = None
    groups: tuple[KVGroupShape, ...] = ()
    parallel: ParallelShape | None = None
    kv_cache_layout: str | None = None
    hash_algorithm: str | None = None

    @classmethod
    def from_preset(
        cls, model: str, gpu_block_size: int = 16, dtype: str = "bfloat16", world_size: int = 1
    ) -> KVLayout:
        """The layout of a known model (see `MODEL_PRESETS`).

        Raises:
            ValueError: unknown model or dtype (the message lists the known ones).
        """
        if model not in MODEL_PRESETS:
            raise ValueError(f"unknown model preset {model!r}; known presets: {', '.join(sorted(MODEL_PRESETS))}")
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {dtype!r}; known dtypes: {', '.join(sorted(DTYPE_BYTES))}")
        layers, kv_heads, head_dim, *groups = MODEL_PRESETS[model]
        kv_groups = groups[0] if groups else 1
        per_layer = 2 * kv_heads * head_dim * DTYPE_BYTES[dtype]
        return cls(model, layers // kv_groups, per_layer, gpu_block_size, dtype, world_size, kv_groups)

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token in every layer, bytes."""
        return self.num_layers * self.kv_bytes_per_token_per_layer

    def identity(self, block_size: int, bytes_per_block: int, model_version: str | None = None) -> EngineIdentity:
        """The identity of an engine of this layout offloading blocks of `block_size` tokens
        and `bytes_per_block` bytes (one CPU row, every worker's slot), under the operator's
        `model_version` (or None: none set): the one place an engine's identity is made.
        Any thread; pure, raises nothing."""
        return EngineIdentity(
            model=self.model,
            kv_dtype=self.dtype,
            tokens_per_block=block_size,
            bytes_per_block=bytes_per_block,
            tokens_per_hash=self.tokens_per_hash or self.gpu_block_size,
            model_revision=self.revision,
            model_version=model_version,
            groups=self.groups,
            group_count=len(self.groups) or self.kv_groups,
            parallel=self.parallel or ParallelShape(tensor=self.world_size),
            kv_cache_layout=self.kv_cache_layout,
            hash_algorithm=self.hash_algorithm,
        )


def block_tokens(config: TieringConfig, layout: KVLayout) -> int:
    """Tokens per offloaded block of an engine of `config` over `layout`: the config's
    ``block_size``, else the layout's GPU block (vLLM's default, 16 tokens for a preset). The
    one rule of the engine, ``tiering-config check --model`` and ``tiering-bench --model``.
    Pure; any thread."""
    return config.block_size or layout.gpu_block_size


class TieringOffloadingSpec:
    """Everything an engine needs, sized from `config` and `layout`.

    Attributes:
        block_size: tokens per offloaded block.
        block_size_factor: GPU blocks per offloaded block.
        bytes_per_block: bytes of one offloaded block (one CPU row, all workers).
        cpu_page_size_per_worker: bytes of one worker's slot of a row.
        num_blocks: rows of the primary tier.
        identity: the engine's `EngineIdentity` (computed once, here).
        layout_fingerprint: the identity's 16-byte digest: with the weights' version,
            it names the tier's namespace (`tiering.contract.identity.namespace`).
        async_runtime: the event loop the secondary tiers share.
        store_reserve_rows: CPU rows kept from promotions for the GPU's stores
            (`TieringOffloadingManager`): the config's, 0 when it has none; an adapter that
            knows the serving engine's step budget sets it before `get_manager`.
    """

    def __init__(self, config: TieringConfig, layout: KVLayout, instance_id: str, enable_events: bool = False):
        """
        Args:
            config: the validated configuration.
            layout: the model's KV layout.
            instance_id: names the shared-memory region; every process of the engine uses it.
            enable_events: collect KV events for `take_events`.

        Raises:
            ConfigError: ``block_size`` is not a multiple of the GPU block size, a block does
                not split evenly between workers, or ``cpu_bytes_to_use`` holds no whole block.
        """
        self.config, self.layout, self.instance_id = config, layout, instance_id
        self.enable_events = enable_events
        self.gpu_block_size = layout.gpu_block_size
        self.block_size = block_tokens(config, layout)
        if self.block_size % self.gpu_block_size:
            problem = f"{self.block_size} is not a multiple of the GPU block size {self.gpu_block_size}"
            raise ConfigError(config.source, [("block_size", problem)])
        self.block_size_factor = self.block_size // self.gpu_block_size
        self.bytes_per_block = layout.kv_bytes_per_token * self.block_size
        if self.bytes_per_block % layout.world_size:
            problem = f"a block of {self.bytes_per_block} bytes does not split between {layout.world_size} workers"
            raise ConfigError(config.source, [("block_size", problem)])
        self.cpu_page_size_per_worker = self.bytes_per_block // layout.world_size
        self.num_blocks = config.cpu_bytes_to_use // self.bytes_per_block
        if self.num_blocks < 1:
            problem = (
                f"{config.cpu_bytes_to_use} bytes is smaller than one block "
                f"({self.bytes_per_block} bytes: {self.block_size} tokens of {layout.kv_bytes_per_token} bytes)"
            )
            raise ConfigError(config.source, [("cpu_bytes_to_use", problem)])
        self.identity = layout.identity(self.block_size, self.bytes_per_block, config.model_version)
        self.layout_fingerprint = self.identity.digest()
        self.store_reserve_rows = config.store_reserve_rows or 0
        self.async_runtime = AsyncRuntime("tiering-io")
        atexit.register(self.shutdown)  # a forgotten shutdown still releases shared memory and threads
        self._manager: TieringOffloadingManager | None = None
        self.exporter: Any = None  # a PrometheusExporter when the config has `metrics`
        self._workers: list[tuple[Any, SharedOffloadRegion]] = []

    @property
    def survival(self) -> Survival | None:
        """How the CPU tier outlives the engine (``cpu_tier.survive_crash``), or None."""
        cpu_tier = self.config.cpu_tier
        if not cpu_tier.survive_crash:
            return None
        return Survival(self.layout_fingerprint, cpu_tier.keep_on_stop)

    @property
    def keep_digest(self) -> bytes | None:
        """The compatibility digest of a CPU tier that outlives the engine: of this identity and
        the configured weights; None where it dies with the engine."""
        survival = self.survival
        return None if survival is None else survival.digest(self.config.weight_version or CHECKPOINT)

    def tier_context(self, primary_kv_view: memoryview, name: str) -> TierContext:
        """What a secondary tier named `name` gets from this engine: the primary rows, the
        identity's digest and manifest, and the shared runtime."""
        weights = self.config.weight_version or CHECKPOINT
        return TierContext(
            name, primary_kv_view, self.layout_fingerprint, self.async_runtime, self, self.identity.manifest(), weights
        )

    @property
    def manager(self) -> TieringOffloadingManager | None:
        """The manager once `get_manager` has built it, else None (nothing is built)."""
        return self._manager

    def get_manager(self) -> TieringOffloadingManager:
        """The scheduler-side manager, built on first call: the shared region, the primary
        tier, then the secondary tiers in config order. On failure everything already made
        is released before the error propagates.

        Raises:
            OSError: the shared region cannot be created.
            ConfigError: ``metrics`` is set but prometheus_client is missing or the port
                cannot be listened on (it names the address and port).
            RegionInUseError: another live engine uses this instance id.
            ConfigError: ``cpu_bytes_to_use`` is more than the free shared memory, or a
                secondary tier cannot be built (its storage cannot be opened, an
                option does not fit the layout); names the file and the tier, and chains
                the tier's own error. Or ``request_log`` cannot be opened for appending.
        """
        if self._manager is not None:
            return self._manager
        region = primary = None
        tiers: list[SecondaryTierManager] = []
        try:
            region = self._create_region()
            primary = CPUPrimaryTierOffloadingManager(
                self.num_blocks,
                region,
                self.config.eviction_policy,
                self.enable_events,
                self.config.tenants,
                self.config.retention_max_fraction,
                self.survival,
            )
            self._create_tiers(primary.get_kv_memoryview(), tiers)
            admission = [AdmissionConfig(**tier.get("admission", {})) for tier in self.config.secondary_tiers]
            try:
                self._manager = TieringOffloadingManager(
                    primary,
                    tiers,
                    self.enable_events,
                    admission=admission,
                    block_tokens=self.block_size,
                    recompute_tokens_per_s=self.config.recompute_tokens_per_s,
                    request_log=self.config.request_log,
                    max_promotion_rows=self.config.max_promotion_rows,
                    store_reserve_rows=self.store_reserve_rows,
                    job_deadline_s=self.config.job_deadline_s,
                    reset_scope=self.config.reset_scope,
                    shutdown_drain_s=self.config.shutdown_drain_s,
                )
            except OSError as exc:
                problem = f"cannot be opened for appending: {exc.strerror}"
                raise ConfigError(self.config.source, [("request_log", problem)]) from exc
        except BaseException:
            for tier in tiers:
                tier.abandon()
            if primary is not None:
                primary.shutdown()
            elif region is not None:
                region.cleanup()
            self.async_runtime.shutdown()
            raise
        if self.config.metrics is not None:
            self._start_exporter()
        logger.info(
            "engine ready: %d CPU blocks of %d bytes (%s), %d secondary tier(s)",
            self.num_blocks,
            self.bytes_per_block,
            self.config.eviction_policy,
            len(tiers),
        )
        return self._manager

    def _create_region(self) -> SharedOffloadRegion:
        """The shared region of the CPU tier's rows (regions of engines killed while starting
        are removed first).

        Raises:
            ConfigError: ``cpu_bytes_to_use`` is more than the free shared memory.
            OSError, RegionInUseError: as `SharedOffloadRegion`.
        """
        SharedOffloadRegion.remove_stale()
        try:
            return SharedOffloadRegion(
                self.instance_id,
                self.num_blocks,
                self.cpu_page_size_per_worker,
                self.layout.world_size,
                keep=self.keep_digest,
            )
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            raise ConfigError(self.config.source, [("cpu_bytes_to_use", str(exc.strerror))]) from exc

    def _create_tiers(self, view: memoryview, tiers: list[SecondaryTierManager]) -> None:
        """Build the secondary tiers over the CPU tier's rows `view`, in config order,
        appending each to `tiers` as it opens (the caller abandons them if one fails).

        Raises:
            ConfigError: a tier cannot be built; names the file and the tier, and chains the
                tier's own error.
        """
        for index, tier_config in enumerate(self.config.secondary_tiers):
            try:
                tiers.append(SecondaryTierFactory.create_secondary_tier(tier_config, view, self))
            except TierConfigError as exc:
                raise ConfigError(self.config.source, exc.located(f"secondary_tiers[{index}]")) from exc
            except Exception as exc:
                raise ConfigError(self.config.source, [(f"secondary_tiers[{index}]", describe(exc))]) from exc

    def _start_exporter(self) -> None:
        metrics = self.config.metrics
        assert metrics is not None and self._manager is not None
        try:
            from tiering.engine.metrics import PrometheusExporter
        except ImportError:
            self.shutdown()
            problem = "needs prometheus_client (pip install 'kv-tiering[metrics]')"
            raise ConfigError(self.config.source, [("metrics", problem)]) from None
        try:
            labels = {"instance": self.instance_id, "model": self.layout.model}
            self.exporter = PrometheusExporter(metrics.port, metrics.address, labels)
        except OSError as exc:
            self.shutdown()
            problem = describe_bind_error(exc, metrics.address, metrics.port)
            raise ConfigError(self.config.source, [("metrics.port", problem)]) from exc
        self.exporter.attach(self._manager, metrics.interval_s)
        logger.info("metrics on http://%s:%d/metrics", metrics.address, self.exporter.port)

    def create_handlers(self, kv_caches: Any, rank: int = 0) -> Any:
        """Worker side: `CpuGpuOffloadingHandlers` for `kv_caches` (a `CanonicalKVCaches`),
        copying into rank `rank`'s slot of the shared region (needs torch).

        Raises:
            ValueError: the caches' pages do not fill the worker's slot exactly.
        """
        from tiering.worker.cpu_gpu import CpuGpuOffloadingHandlers

        pages = sum(entry.page_size_bytes for entry in kv_caches.tensors) * self.block_size_factor
        if pages != self.cpu_page_size_per_worker:
            raise ValueError(
                f"the KV caches hold {pages} bytes per offloaded block; the layout gives each worker "
                f"{self.cpu_page_size_per_worker}"
            )
        region = SharedOffloadRegion(
            self.instance_id,
            self.num_blocks,
            self.cpu_page_size_per_worker,
            self.layout.world_size,
            rank,
            keep=self.keep_digest,
        )
        try:
            handlers = CpuGpuOffloadingHandlers(kv_caches, self.block_size_factor, self.num_blocks, mmap_region=region)
        except BaseException:
            region.cleanup()
            raise
        self._workers.append((handlers, region))
        return handlers

    def get_handlers(self, kv_caches: Any, rank: int = 0) -> Iterator[tuple[type, type, Any]]:
        """(source spec type, destination spec type, handler) for both directions: the
        seeds' ``OffloadingSpec.get_handlers`` contract, for a scheduler that takes its
        handlers so (the vLLM adapter calls `create_handlers` itself).

        Raises:
            ValueError: as `create_handlers`.
        """
        handlers = self.create_handlers(kv_caches, rank)
        yield GPULoadStoreSpec, CPULoadStoreSpec, handlers.gpu_to_cpu_handler
        yield CPULoadStoreSpec, GPULoadStoreSpec, handlers.cpu_to_gpu_handler

    def __enter__(self) -> TieringOffloadingSpec:
        """``with TieringOffloadingSpec(...) as spec:`` shuts everything down on exit."""
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Stop the handlers, the manager (tiers, primary tier, shared memory) and the
        runtime. Safe to call more than once; also runs at interpreter exit if forgotten."""
        atexit.unregister(self.shutdown)
        for handlers, region in self._workers:
            handlers.shutdown()
            region.cleanup()
        self._workers.clear()
        if self.exporter is not None:
            self.exporter.close()
        if self._manager is not None:
            self._manager.shutdown()
        self.async_runtime.shutdown()
