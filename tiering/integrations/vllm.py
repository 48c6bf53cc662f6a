"""vLLM adapter: this engine behind vLLM's `OffloadingConnector` (the ``vllm`` extra).

A vLLM user switches to it with the engine's connector (`tiering.integrations.vllm_connector`,
which builds this spec and loads into the step that schedules a hit), or by naming the spec in the extra config
of vLLM's own connector::

    kv_transfer_config={"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "KVTieringOffloadingSpec",
            "spec_module_path": "tiering.integrations.vllm",
            "cpu_bytes_to_use": 8 << 30, "eviction_policy": "arc",
            "secondary_tiers": [{"type": "file", "root_dir": "/mnt/nvme/kv"}]}}

The engine keys are those of the YAML configuration, validated by the same code with the
same errors (the source is ``kv_connector_extra_config``); ``config_file: engine.yaml``
reads them from a file instead (the one `tiering-bench` uses), and vLLM's tier names ``fs``
and ``obj`` are accepted for ``file`` and ``s3``.

What it translates between vLLM's API (0.32.x and 0.33.x) and the engine's (the seeds'):

- sizing from `OffloadingConfig`: a CPU row holds ``blocks_per_chunk`` GPU blocks of
  ``worker_kv_bytes_per_block`` bytes per worker; the shared-memory id is ``engine_id``;
  the engine's identity (`tiering.integrations.vllm_identity`): model, revision, KV dtype,
  tokens per row and per hash, every KV-cache group, the parallel split, the memory layout;
- lookups: True and False become ``HIT`` and ``MISS``; None becomes ``HIT_PENDING`` when
  the block's primary row is being written (a GPU store in flight, or a promotion this or
  an earlier lookup started), as vLLM's own managers answer, and ``RETRY`` otherwise (a
  secondary tier is not sure yet). vLLM's scheduler counts a pending hit in the prefix and
  defers the request; a retry only defers it. Under the engine's connector a block whose
  promotion the worker's load can wait for is a ``HIT`` at once
  (`TieringOffloadingManager.answer_pending_hits`); a promotion that then fails becomes
  vLLM load errors, which it recomputes. `get_load_source` says ``HOST`` for blocks
  stored from the GPU, ``DISK`` for blocks promoted from a tier of type ``file`` (whatever
  its name), ``EXTERNAL_UNSPECIFIED`` from any other;
- vLLM's spec classes (int32 ids) both ways, ``ScheduleEndContext``, ``CHUNK_LEVEL``
  requests, events with vLLM's ``Medium``;
- stats: the engine's per-tier counts (hits, stores, loads, cascades dropped, failed jobs,
  refusals) as vLLM connector stats and ``vllm:kv_tiering_*`` metrics
  (`tiering.integrations.vllm_stats`);
- the worker: an `OffloadingWorker` over the engine's GPU<->CPU handlers. vLLM asserts that
  every transfer it submits succeeds; the handlers refuse only malformed specs, which is
  raised as a bug, never returned as a failure. Their results carry bytes and seconds, so
  vLLM's ``vllm:kv_offload_*`` byte and time counters count them. Secondary-tier failures
  stay inside the manager (a failed promotion is a miss).

Hybrid models (several KV-cache groups: sliding-window and full-attention layers, as in
gpt-oss, Gemma 2 and 3, Cohere2): vLLM's offloading keys are block hash + group index, so
each group's blocks are blocks of their own here, in a row each; vLLM's hybrid cache lays
every group's layers over the same tensors, so one row holds one group's pages of a block
and is the same size for every group. vLLM's offloading scheduler decides what each group
stores, looks up and loads (a sliding-window group: its in-window tail only), and records
each key's token position, by which a finished request's blocks are ranked head to tail
across groups (`tiering.cpu.request_access`). Hits are counted by group
(``hit_blocks_by_group``).

Not supported (refused at start with a message): KV-cache groups of different block sizes
(Mamba and linear-attention layers; `KVTieringConnector` names the group kind), vLLM versions
outside `SUPPORTED_VERSIONS`.

The class is `KVTieringOffloadingSpec`: vLLM's factory looks ``spec_name`` up in its own
registry before it reads ``spec_module_path``, and vLLM registers a ``TieringOffloadingSpec``
of its own, so a spec of that name here would never be loaded. `TieringOffloadingSpec` is
an alias for imports.

Thread: vLLM's scheduler thread calls `_Manager`; each worker process's thread calls
`_Worker`; what they call is documented with the engine's classes.
"""

from __future__ import annotations

import atexit
import logging
import weakref
from collections.abc import Collection, Iterable
from typing import Any, cast

import vllm
from packaging.version import Version
from vllm.config import get_current_vllm_config_or_none
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    GPULoadStoreSpec as VllmGPUSpec,
)
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
    OffloadKey,
    OffloadPolicy,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.base import (
    OffloadingEvent as VllmEvent,
)
from vllm.v1.kv_offload.base import (
    PrepareStoreOutput as VllmPrepareStoreOutput,
)
from vllm.v1.kv_offload.base import (
    TransferResult as VllmTransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec as VllmCPUSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tiering.contract.keys import OffloadKey as Key
from tiering.contract.mediums import CPULoadStoreSpec, GPULoadStoreSpec
from tiering.engine.manager import TieringOffloadingManager
from tiering.errors import ConfigError
from tiering.integrations.vllm_config import engine_config, warn_unshared_hashes
from tiering.integrations.vllm_identity import vllm_layout
from tiering.integrations.vllm_sizing import check_cpu_tier_size, rows_for_one_step
from tiering.integrations.vllm_stats import VllmStats, metric_definitions
from tiering.integrations.vllm_weights import DeclaredWeights
from tiering.spec import TieringOffloadingSpec as EngineSpec

logger = logging.getLogger(__name__)

SUPPORTED_VERSIONS = ("0.32", "0.33")
"""vLLM release series whose offloading API this adapter speaks."""
_LOOKUP = {True: LookupResult.HIT, False: LookupResult.MISS, None: LookupResult.RETRY}
_SOURCES = {"file": CacheHitSource.DISK}
_LIVE: weakref.WeakSet[KVTieringOffloadingSpec] = weakref.WeakSet()


def live_specs() -> list[KVTieringOffloadingSpec]:
    """The specs vLLM built in this process and not shut down yet (for tests and in-process
    introspection: ``spec.engine.manager.get_stats()`` on the scheduler's)."""
    return [spec for spec in _LIVE if not spec._closed]


def check_version(version: str = vllm.__version__) -> None:
    """Raises RuntimeError, naming the supported series, for a vLLM this adapter does not know."""
    release = Version(version).release
    if f"{release[0]}.{release[1]}" not in SUPPORTED_VERSIONS:
        raise RuntimeError(
            f"tiering.integrations.vllm supports vLLM {' and '.join(f'{v}.x' for v in SUPPORTED_VERSIONS)}; "
            f"this is vLLM {version}"
        )


def log_like_vllm() -> None:
    """Send the engine's log lines (``engine ready``, tier recovery, the breaker, shedding)
    through vLLM's own handlers, at vLLM's level, as vLLM's modules log: vLLM configures only
    its ``vllm`` logger, so under ``vllm serve`` the engine's lines would go nowhere. Nothing
    changes where the application configured logging itself (handlers on the root logger or
    on ``tiering``, as pytest and most services do), or where vLLM's logging is off. Called
    in every process that builds the spec; idempotent."""
    ours, theirs = logging.getLogger("tiering"), logging.getLogger("vllm")
    if ours.handlers or logging.getLogger().handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level)
    ours.propagate = False


class KVTieringOffloadingSpec(OffloadingSpec):
    """vLLM's `OffloadingSpec` for this engine. Built once by the scheduler (`get_manager`)
    and once by each worker (`get_worker`), in their processes. Where vLLM's config is
    current (a worker's construction), rank 0 checks the CPU tier against vLLM's token
    budget (`check_cpu_tier_size`).

    Raises (at construction):
        RuntimeError: an unsupported vLLM version.
        ConfigError: the extra config is invalid (file or ``kv_connector_extra_config``, key
            path, problem).
        ValueError: KV-cache groups of different block sizes, or a block that does not split
            into tokens.
    """

    def __init__(self, config: OffloadingConfig):
        check_version()
        log_like_vllm()
        super().__init__(config)
        sizes = sorted({group.tokens_per_block for group in config.groups})
        if len(sizes) != 1:
            raise ValueError(
                f"tiering.integrations.vllm needs one block size in every KV-cache group; this model's groups have "
                f"{sizes} tokens per block (a Mamba or linear-attention group: not supported)"
            )
        tokens = sizes[0]
        world_size = max(1, config.parallel.world_size)
        block_bytes = config.worker_kv_bytes_per_block * world_size
        if block_bytes % tokens:
            raise ValueError(f"a GPU block of {block_bytes} bytes does not split into {tokens} tokens")
        # Set where vLLM builds a worker's connector, and by `KVTieringConnector` on both sides.
        vllm_config = get_current_vllm_config_or_none()
        layout = vllm_layout(config, vllm_config, block_bytes // tokens, tokens)
        try:
            tiering_config = engine_config(config.extra_config, tokens * self.blocks_per_chunk)
        except ConfigError as exc:
            logger.error(
                "kv-tiering cannot start, invalid configuration: %s. (vLLM builds the engine after loading the "
                "model; check a configuration before: tiering-config check --kv-transfer-config '<JSON>')",
                "; ".join(exc.lines),
            )
            raise
        tiering_config = tiering_config.model_copy(update={"block_size": tokens * self.blocks_per_chunk})
        self.engine = EngineSpec(tiering_config, layout, config.engine_id, config.enable_kv_cache_events)
        budget = None if vllm_config is None else vllm_config.scheduler_config.max_num_batched_tokens
        if tiering_config.store_reserve_rows is None:  # a step's stores; half the tier where the step is unknown
            step_rows = (
                self.engine.num_blocks
                if budget is None
                else rows_for_one_step(budget, self.engine.block_size, len(config.groups))
            )
            self.engine.store_reserve_rows = min(step_rows, self.engine.num_blocks // 2)
        if budget is not None and config.parallel.rank == 0:
            check_cpu_tier_size(self.engine, budget, len(config.groups))
        if vllm_config is not None and config.parallel.rank == 0:
            warn_unshared_hashes(tiering_config, str(vllm_config.cache_config.prefix_caching_hash_algo))
        self._closed = False
        _LIVE.add(self)
        atexit.register(self.shutdown)  # a forgotten shutdown still releases shared memory and threads

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        """The engine's per-tier counters vLLM registers (see `tiering.integrations.vllm_stats`)."""
        return metric_definitions()

    def get_manager(self) -> OffloadingManager:
        """The scheduler-side manager (built on first call)."""
        return _Manager(self.engine.get_manager(), self)

    def get_worker(self, kv_caches: Any) -> OffloadingWorker:
        """This worker's transfers, over vLLM's canonical KV caches (duck-typed).

        Raises:
            RuntimeError: vLLM handed this spec the KV caches of another engine (see
                `_check_own_engine`).
        """
        self._check_own_engine()
        return _Worker(self.engine.create_handlers(kv_caches, self.config.parallel.rank), self)

    def _check_own_engine(self) -> None:
        """vLLM keeps one worker-side KV connector per process and reuses it for a later
        engine of the same process while the earlier engine's workers have not shut down.
        That connector's spec would copy the later engine's KV through the earlier engine's
        CPU tier, which the later scheduler never sees: its stores would cascade empty rows
        to shared tiers under valid keys, and its loads would bring stale KV (wrong output,
        measured). Refuse instead, naming both engines and the fix.

        Raises:
            RuntimeError: this spec was shut down, or vLLM is building another engine.
        """
        current = get_current_vllm_config_or_none()
        transfer = None if current is None else current.kv_transfer_config
        other = getattr(transfer, "engine_id", None)
        if self._closed or (other is not None and other != self.engine.instance_id):
            state = "was shut down" if self._closed else "has not shut down its workers"
            raise RuntimeError(
                f"vLLM gave engine {other or '(unknown)'} the KV connector of engine {self.engine.instance_id}, "
                f"which {state} in this process (vLLM keeps one connector per process until an engine's workers "
                "shut down): shut the earlier LLM down first (llm.llm_engine.engine_core.shutdown()), or run each "
                "engine in a process of its own"
            )

    def shutdown(self) -> None:
        """Stop everything this spec built (safe to call more than once)."""
        if not self._closed:
            self._closed = True
            atexit.unregister(self.shutdown)
            self.engine.shutdown()


class _Manager(OffloadingManager):
    """vLLM's manager API over `TieringOffloadingManager` (scheduler thread)."""

    def __init__(self, manager: TieringOffloadingManager, spec: KVTieringOffloadingSpec):
        self.manager, self.spec = manager, spec
        self._sources = {  # by tier name: the source of a block promoted from it, by the tier's type
            name: _SOURCES.get(tier.tier_type, CacheHitSource.EXTERNAL_UNSPECIFIED)
            for name, tier in zip(manager.tier_names, manager.secondary_tiers, strict=True)
        }
        self._stats = VllmStats(manager)
        self._salts: dict[str, str] = {}  # request id -> cache_salt, from `KVTieringConnector`
        self.weights = DeclaredWeights(spec and spec.engine.config.weight_version)  # what a reset moves tiers to

    def declare_weight_version(self, version: str) -> bool:
        """vLLM set its weight version (`tiering.integrations.vllm_plugin`): `DeclaredWeights.declare`."""
        return self.weights.declare(version)

    def loads_waited(self, waits: dict[str, float]) -> None:
        """Seconds the workers' loads of each request (by id) waited for promoted rows, for
        the request log (`tiering.engine.timeline`); from the engine's connector."""
        for req_id, seconds in waits.items():
            self.manager.load_waited(req_id, seconds)

    def set_cache_salt(self, req_id: str, cache_salt: str) -> None:
        """Make `cache_salt` the tenant of request `req_id` (`tiering.cpu.tenants`), from the
        time vLLM announces the request until it finishes."""
        self._salts[req_id] = cache_salt

    def lookup(self, key: OffloadKey, req_context: Any) -> LookupResult:
        answer = self.manager.lookup(_ours(key), req_context)
        if answer is None and self.manager.primary_tier.write_in_flight(_ours(key)):
            return LookupResult.HIT_PENDING
        return _LOOKUP[answer]

    def get_load_source(self, key: OffloadKey, req_context: Any) -> CacheHitSource:
        tier = self.manager.promotion_source(_ours(key))
        if tier is None:
            return CacheHitSource.HOST
        return self._sources[tier]

    def prepare_load(self, keys: Collection[OffloadKey], req_context: Any) -> VllmCPUSpec:
        return VllmCPUSpec(self.manager.prepare_load(_all_ours(keys), req_context).block_ids.tolist())

    def touch(self, keys: Collection[OffloadKey], req_context: Any) -> None:
        self.manager.touch(_all_ours(keys), req_context)

    def complete_load(self, keys: Collection[OffloadKey], req_context: Any) -> None:
        self.manager.complete_load(_all_ours(keys), req_context)

    def prepare_store(self, keys: Collection[OffloadKey], req_context: Any) -> VllmPrepareStoreOutput | None:
        out = self.manager.prepare_store(_all_ours(keys), req_context)
        if out is None:
            return None
        spec = VllmCPUSpec(out.store_spec.block_ids.tolist())
        return VllmPrepareStoreOutput(_all_theirs(out.keys_to_store), spec, _all_theirs(out.evicted_keys))

    def complete_store(self, keys: Collection[OffloadKey], req_context: Any, success: bool = True) -> None:
        self.manager.complete_store(_all_ours(keys), req_context, success)

    def on_new_request(self, req_context: Any) -> RequestOffloadingContext:
        salt = self._salts.get(req_context.req_id)
        if salt is not None:  # vLLM's context is a plain dataclass: its tenant rides along
            req_context.tenant = salt
        self.manager.on_new_request(req_context)
        return RequestOffloadingContext(policy=OffloadPolicy.CHUNK_LEVEL)

    def on_request_finished(self, req_context: Any) -> None:
        self.manager.on_request_finished(req_context)
        self._salts.pop(req_context.req_id, None)

    def take_events(self) -> Iterable[VllmEvent]:
        for event in self.manager.take_events():
            yield VllmEvent(
                keys=_all_theirs(event.keys),
                medium=Medium.CPU if event.medium == "CPU" else Medium.STORAGE,
                removed=event.removed,
                locality=_LOCALITIES.get(event.locality),  # None: unsaid (a third-party tier's own events)
                ownership=event.ownership,
                removal_expected=event.removal_expected,
            )

    def on_schedule_end(self, context: ScheduleEndContext | None = None) -> None:
        self.manager.on_schedule_end()

    def has_pending_work(self) -> bool:
        return self.manager.has_pending_work()

    def reset_cache(self) -> None:
        """vLLM's connector reset: to the weights declared last (`declare_weight_version`)."""
        self.manager.reset_cache(self.weights.version)

    def get_stats(self) -> OffloadingConnectorStats | None:
        return self._stats.take()  # transfer bytes and seconds reach vLLM through the worker's results

    def shutdown(self) -> None:
        self.spec.shutdown()


class _Worker(OffloadingWorker):
    """vLLM's worker API over the engine's `CpuGpuOffloadingHandlers` (worker thread).

    A load whose rows' promotion failed succeeds for vLLM (its worker asserts that every
    transfer does) and leaves the GPU blocks of those rows unwritten; they gather in
    `load_errors`, which the engine's connector reports as vLLM's load errors. The seconds
    loads waited for promoted rows gather by job in `load_waits`.

    A transfer that failed itself (its copy raised) fails vLLM's worker, which asserts that
    none does, unless `recover_failed_transfers` is set (by the engine's connector, which
    reports load errors): then it succeeds for vLLM, a load's blocks all become load errors
    (vLLM recomputes them), and a store's rows are ``FAILED``, which the CPU tier reads
    when vLLM completes the store: the blocks are not kept (`tiering.worker.cpu_gpu`)."""

    def __init__(self, handlers: Any, spec: KVTieringOffloadingSpec):
        self.handlers, self.spec = handlers, spec
        self.load_errors: set[int] = set()
        self.load_waits: dict[int, float] = {}
        self.recover_failed_transfers = False

    def submit_store(self, job_id: int, src_spec: VllmGPUSpec, dst_spec: Any) -> bool:
        return self._submit(self.handlers.gpu_to_cpu_handler, job_id, (_gpu(src_spec), _cpu(dst_spec)))

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: VllmGPUSpec) -> bool:
        return self._submit(self.handlers.cpu_to_gpu_handler, job_id, (_cpu(src_spec), _gpu(dst_spec)))

    @staticmethod
    def _submit(handler: Any, job_id: int, specs: tuple[Any, Any]) -> bool:
        if not handler.transfer_async(job_id, specs):  # only a malformed spec: a bug, not a failure
            raise RuntimeError(f"transfer {job_id}: the specs {specs!r} do not fit this engine's layout")
        return True

    def get_finished(self) -> list[VllmTransferResult]:
        results = self.handlers.gpu_to_cpu_handler.get_finished() + self.handlers.cpu_to_gpu_handler.get_finished()
        recover = self.recover_failed_transfers
        for result in results:
            self.load_errors.update(result.failed_block_ids)
            if result.wait_time:
                self.load_waits[result.job_id] = result.wait_time
        return [VllmTransferResult(r.job_id, r.success or recover, r.transfer_size, r.transfer_time) for r in results]

    def take_load_errors(self) -> set[int]:
        """The GPU blocks loads left unwritten since the last call (see the class)."""
        errors, self.load_errors = self.load_errors, set()
        return errors

    def take_load_waits(self) -> dict[int, float]:
        """Seconds each load job (by id) waited for promoted rows, since the last call."""
        waits, self.load_waits = self.load_waits, {}
        return waits

    def wait(self, job_ids: set[int]) -> None:
        self.handlers.gpu_to_cpu_handler.wait(job_ids)
        self.handlers.cpu_to_gpu_handler.wait(job_ids)

    def shutdown(self) -> None:
        self.spec.shutdown()


def _ours(key: OffloadKey) -> Key:
    return cast(Key, key)  # both are block hash + 4-byte group index


_LOCALITIES = {locality.value: locality for locality in Locality}


def _all_ours(keys: Collection[OffloadKey]) -> Collection[Key]:
    return cast(Collection[Key], keys)


def _all_theirs(keys: Collection[Key]) -> list[OffloadKey]:
    return cast(list[OffloadKey], list(keys))


def _gpu(spec: Any) -> GPULoadStoreSpec:
    return GPULoadStoreSpec(spec.block_ids, list(spec.group_sizes), list(spec.block_indices))


def _cpu(spec: Any) -> CPULoadStoreSpec:
    return CPULoadStoreSpec(spec.block_ids)


TieringOffloadingSpec = KVTieringOffloadingSpec
