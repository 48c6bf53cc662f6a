"""`KVTieringConnector`: vLLM's `OffloadingConnector` whose loads feed the step that
schedules them.

Under vLLM's own connector a hit costs two engine steps before the request computes. In
step N the scheduler submits the load and parks the request (``WAITING_FOR_REMOTE_KVS``);
the worker starts the load after step N's forward and polls it at once (still copying);
it reports the load after step N+1's forward; the request computes in step N+2. A request
whose prefix is in vLLM's own cache computes in step N. Each step waited is a forward of
the rest of the batch: milliseconds on an idle server, a prefill chunk (100+ ms on CPU)
on a busy one.

Here a hit costs no step: the request computes in step N, like a hit in vLLM's own cache.

- The lookup answers that its tokens load synchronously (``load_kv_async`` False), so
  vLLM schedules the request's remaining tokens in step N and marks the step
  ``has_sync_kv_loads``: the worker starts its loads before the forward and waits for
  them there (`start_load_kv`), and the forward reads the loaded blocks.
- vLLM hashes the GPU blocks of a synchronous load as it allocates them, while its
  offloading scheduler finds where a load starts by the first block without a hash (true
  of asynchronous loads only); `update_state_after_alloc` shows it the blocks past the
  locally computed ones as fresh, and the plan is the same as for an asynchronous load.
- vLLM expects "done receiving" of asynchronous loads only: `get_finished` reports none
  (the finished jobs still reach the scheduler in the worker metadata).
- A request that loads also computes in that step, and may store the blocks it computes
  in the same step, which vLLM's offloading scheduler refuses while a load of the request
  is pending (`build_connector_meta`).

The cost is the batch's: step N's forward waits for the copy (and for any promotion read
it needs), where an asynchronous load ran beside it.

A block found only in a secondary tier costs no extra step either. Under vLLM's connector
its lookup answers "pending" until the promotion has landed in the CPU tier and the
scheduler noticed, steps later; here it answers "hit" in the step the promotion starts
(`TieringOffloadingManager.answer_pending_hits`), and that step's load waits for the rows
in the worker (`tiering.cpu.row_states`). If the promotion fails, or takes longer than
`tiering.cpu.row_states.PROMOTION_WAIT_S`, the load leaves those GPU blocks unwritten and the
connector reports them as load errors (`get_block_ids_with_load_errors`): vLLM drops the
step's output for that request and recomputes the blocks, so a failed promotion costs the
prefill it would have saved, never wrong output. That needs vLLM's
``kv_load_failure_policy`` at ``"recompute"``: the connector sets it (and says so in the
log) where it is vLLM's default ``"fail"``, which would fail the request instead.

A transfer that fails in the worker (its copy raises: a bug, a device error) takes the same
way instead of failing vLLM's worker, which asserts that no transfer fails: a load's blocks
become load errors, recomputed; a store's blocks are not kept (`register_kv_caches`).

It also tells the engine each request's ``cache_salt``, which is the request's tenant
(`tiering.cpu.tenants`); under vLLM's own connector every request is the default tenant.

Use it in place of ``OffloadingConnector``; the extra config is the same, with this
engine's spec as the default::

    kv_transfer_config={"kv_connector": "KVTieringConnector",
        "kv_connector_module_path": "tiering.integrations.vllm_connector",
        "kv_role": "kv_both", "kv_connector_extra_config": {"cpu_bytes_to_use": 8 << 30}}

Thread: vLLM's scheduler thread runs the lookups and plans; each worker's thread runs the rest.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from vllm.config import set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.kv_cache_interface import SlidingWindowSpec

from tiering.integrations import VLLM_SPEC
from tiering.integrations.vllm_identity import group_specs

logger = logging.getLogger(__name__)


@dataclass
class TieringWorkerMetadata(OffloadingWorkerMetadata):
    """vLLM's worker -> scheduler metadata, plus the seconds each request's load waited for
    rows still being promoted (the longest of the workers'), for the engine's request log."""

    load_waits: dict[str, float] = field(default_factory=dict)

    def aggregate(self, other: Any) -> TieringWorkerMetadata:
        """vLLM's merge of two workers' metadata (scheduler process), keeping each request's
        longest wait. Raises what vLLM's merge raises (metadata of another connector)."""
        merged = super().aggregate(other)
        waits = dict(self.load_waits)
        for req_id, seconds in getattr(other, "load_waits", {}).items():
            waits[req_id] = max(seconds, waits.get(req_id, 0.0))
        return TieringWorkerMetadata(merged.completed_jobs, merged.transfer_stats, waits)


_SCHEDULER_STATE = ("_jobs", "_current_batch_load_jobs")
"""What the connector reads of vLLM's `OffloadingConnectorScheduler` beyond its API (vLLM 0.32)."""


class _FreshBlock(NamedTuple):
    """A GPU block as vLLM's offloading scheduler reads it to find where a load starts: one
    the request has not computed (no hash yet). See `KVTieringConnector.update_state_after_alloc`."""

    block_id: int
    is_null: bool = False
    block_hash: None = None


SUPPORTED_GROUP_KINDS = (
    "FullAttentionSpec",
    "SlidingWindowSpec",
    "MLAAttentionSpec",
    "SlidingWindowMLASpec",
    "ChunkedLocalAttentionSpec",
)
"""The KV-cache group kinds (vLLM's spec classes) the engine offloads: attention whose pages
are a block's tokens, in groups of one block size. Mamba and other state kinds are refused."""


def check_group_kinds(kv_cache_config: Any) -> None:
    """Refuse a model with a KV-cache group of a kind not in `SUPPORTED_GROUP_KINDS`
    (`kv_cache_config`: vLLM's ``KVCacheConfig``). Any thread; reads only.

    Raises:
        ValueError: one line naming the kind and its group.
    """
    for index, group in enumerate(getattr(kv_cache_config, "kv_cache_groups", None) or ()):
        spec = group.kv_cache_spec
        per_layer = getattr(spec, "kv_cache_specs", None)  # vLLM's UniformTypeKVCacheSpecs: a spec per layer
        for one in per_layer.values() if per_layer else (spec,):
            if not any(kind.__name__ in SUPPORTED_GROUP_KINDS for kind in type(one).__mro__):
                layers = ", ".join(group.layer_names[:3]) + (", ..." if len(group.layer_names) > 3 else "")
                raise ValueError(
                    f"KVTieringConnector cannot offload KV-cache group {index} of kind {type(one).__name__} "
                    f"(layers {layers}); it offloads {', '.join(SUPPORTED_GROUP_KINDS)}"
                )


def hit_window(group: Any) -> Any:
    """`group` (vLLM's ``GroupOffloadConfig``) with the chunks a sliding-window hit needs set
    to what vLLM's own KV cache keeps of a window, and hits with in its prefix cache:
    ``cdiv(sliding_window - 1 + extra_retained_tokens, chunk)``. vLLM 0.32's offloading
    scheduler asks for ``cdiv(sliding_window, chunk)``, a chunk more where the window is one
    token past a chunk boundary (Command-R's ``sliding_window + 1``: 65 tokens, 3 chunks of
    32 asked, 2 kept and stored), so every such prefix missed. A group of another kind is
    returned as it is. Any thread; pure."""
    spec = group.kv_cache_spec
    if not isinstance(spec, SlidingWindowSpec) or group.sliding_window_size_in_chunks is None:
        return group
    kept = spec.sliding_window - 1 + spec.extra_retained_tokens
    chunks = max(1, -(-kept // group.tokens_per_chunk))
    return group._replace(sliding_window_size_in_chunks=min(group.sliding_window_size_in_chunks, chunks))


def _name_our_spec(vllm_config: Any) -> None:
    """Make `VLLM_SPEC` the extra config's spec where it names none, in every process that
    reads it (vLLM's offloading code finds the spec in the extra config)."""
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config
    for key, value in VLLM_SPEC.items():
        extra.setdefault(key, value)


class KVTieringConnector(OffloadingConnector):
    """`OffloadingConnector` whose loads finish before the forward of the step that
    schedules them, which computes the request (see the module docstring). Constructed by vLLM, once
    per role and process; raises what `OffloadingConnector` and the spec raise."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any):
        check_group_kinds(kv_cache_config)
        _name_our_spec(vllm_config)
        transfer = vllm_config.kv_transfer_config
        if transfer.kv_load_failure_policy != "recompute":
            logger.info(
                "KVTieringConnector: kv_load_failure_policy %r -> 'recompute': a block whose promotion fails is "
                "recomputed, never loaded (see tiering.integrations.vllm_connector)",
                transfer.kv_load_failure_policy,
            )
            transfer.kv_load_failure_policy = "recompute"
        # the spec reads the step's token budget and the model's identity on both sides
        with set_current_vllm_config(vllm_config), group_specs(kv_cache_config):
            super().__init__(vllm_config, role, kv_cache_config)
        if self.connector_scheduler is not None:
            missing = [name for name in _SCHEDULER_STATE if not hasattr(self.connector_scheduler, name)]
            if missing or not hasattr(self.connector_scheduler.config, "kv_group_configs"):
                raise RuntimeError(
                    f"KVTieringConnector plans synchronous loads with vLLM's offloading scheduler state "
                    f"({', '.join(_SCHEDULER_STATE)}, config.kv_group_configs), which this vLLM lacks "
                    f"({', '.join(missing) or 'kv_group_configs'}); use OffloadingConnector with "
                    f"spec_name {VLLM_SPEC['spec_name']!r} instead"
                )
            self.connector_scheduler.manager.manager.answer_pending_hits = True
            config = self.connector_scheduler.config
            groups = tuple(hit_window(group) for group in config.kv_group_configs)
            self.connector_scheduler.config = config._replace(kv_group_configs=groups)
        self._load_waits: dict[str, float] = {}  # request id -> seconds, until the step's metadata carries them
        self._locally_computed: dict[str, int] = {}  # scheduler: request id -> tokens vLLM's cache had at its lookup

    @classmethod
    def build_prom_metrics(
        cls, vllm_config: Any, metric_types: Any, labelnames: Any, per_engine_labelvalues: Any
    ) -> Any:
        """vLLM's Prometheus metrics of the connector, built in the API server's process
        (which builds no connector): as `OffloadingConnector`'s, for this engine's spec, so
        that they include the engine's own (``vllm:kv_tiering_*``). Without it the process
        registered the default spec's metrics and failed its first stats of ours."""
        _name_our_spec(vllm_config)
        return super().build_prom_metrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """vLLM's lookup of a request's prefix (scheduler thread): (tokens to load beyond
        `num_computed_tokens`, None to ask again next step; at most all but the request's
        last token), and False: the load feeds the forward of the step that schedules it
        (see the module docstring)."""
        tokens, _ = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if tokens:
            # the step must compute at least the last token (vLLM asserts it; an asynchronous
            # load gets the same cut when it lands): the last block still loads whole
            tokens = max(min(tokens, request.num_tokens - 1 - num_computed_tokens), 0)
            self._locally_computed[request.request_id] = num_computed_tokens
        return tokens, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """vLLM's planning of a request's load once its GPU blocks are allocated (scheduler
        thread). vLLM's offloading scheduler loads into the blocks that have no hash yet, as
        after an asynchronous allocation; vLLM hashes the blocks of a synchronous load at
        allocation, so the blocks past the ones computed locally are shown to it as fresh."""
        local = self._locally_computed.pop(request.request_id, None)
        if num_external_tokens and local is not None:
            assert self.connector_scheduler is not None
            groups = list(blocks.blocks)
            for group in self.connector_scheduler.config.kv_group_configs:
                per_block = group.tokens_per_block
                first, end = -(-local // per_block), -(-(local + num_external_tokens) // per_block)
                group_blocks = list(groups[group.group_idx])
                for i in range(first, end):
                    if not group_blocks[i].is_null:
                        group_blocks[i] = _FreshBlock(group_blocks[i].block_id)
                groups[group.group_idx] = group_blocks
            blocks = KVCacheBlocks(tuple(groups))
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Start this step's transfers and wait for its loads (worker thread, before the
        forward they feed; blocks it for as long as the copies, and any promotion reads they
        wait for, take). Raises what vLLM's worker raises."""
        super().start_load_kv(forward_context, **kwargs)
        assert self.connector_worker is not None and self.connector_worker.worker is not None
        assert isinstance(self._connector_metadata, OffloadingConnectorMetadata)
        if self._connector_metadata.load_jobs:
            self.connector_worker.worker.wait(set(self._connector_metadata.load_jobs))

    def on_new_request(self, request: Any) -> None:
        """vLLM's handling of a new request (scheduler side), its ``cache_salt`` passed to
        the engine first as the request's tenant."""
        assert self.connector_scheduler is not None
        salt = getattr(request, "cache_salt", None)
        manager = self.connector_scheduler.manager
        if salt is not None and hasattr(manager, "set_cache_salt"):
            manager.set_cache_salt(request.request_id, salt)
        super().on_new_request(request)

    def build_connector_meta(self, scheduler_output: Any) -> OffloadingConnectorMetadata:
        """vLLM's plan of the step's transfers (scheduler thread). A request that loads in
        this step also computes in it, and may store its new blocks in it; vLLM's offloading
        scheduler asserts that a request stores only with no load pending, true of
        asynchronous loads alone. While it plans the step's stores, the step's loads pass
        for stores: they finish before the forward whose blocks the stores read (and vLLM's
        worker submits the stores after it)."""
        assert self.connector_scheduler is not None
        scheduler = self.connector_scheduler
        loads = [scheduler._jobs[job_id] for job_id in scheduler._current_batch_load_jobs]
        for job in loads:
            job.is_store = True
        try:
            return super().build_connector_meta(scheduler_output)
        finally:
            for job in loads:
                job.is_store = False

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's end of a request (scheduler thread): what `OffloadingConnector` answers,
        after forgetting a lookup the request was never allocated for (aborted waiting)."""
        self._locally_computed.pop(request.request_id, None)
        return super().request_finished(request, block_ids)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """vLLM's report of finished transfers (worker thread): (request ids done sending,
        done receiving). Done receiving is always empty: vLLM expects it of asynchronous
        loads only, and every load here finished before its step's forward (the jobs still
        reach the scheduler, in the worker metadata). Raises what vLLM's worker raises."""
        assert self.connector_worker is not None and self.connector_worker.worker is not None
        requests = dict(self.connector_worker._load_jobs)  # job -> request, forgotten by vLLM's get_finished
        sending, _ = super().get_finished(finished_req_ids)
        for job_id, seconds in self.connector_worker.worker.take_load_waits().items():
            if job_id in requests:
                self._load_waits[requests[job_id]] = seconds
        return sending, set()

    def build_connector_worker_meta(self) -> Any:
        """vLLM's worker metadata, with the seconds this step's loads waited for promoted
        rows (`TieringWorkerMetadata`). Worker thread."""
        meta = super().build_connector_worker_meta()
        if meta is None:
            return None
        waits, self._load_waits = self._load_waits, {}  # every worker sends ours: they aggregate alike
        return TieringWorkerMetadata(meta.completed_jobs, meta.transfer_stats, waits)

    def update_connector_output(self, connector_output: Any) -> None:
        """vLLM's handling of the workers' output (scheduler thread); the waits the
        workers measured go to the engine's request log first."""
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, TieringWorkerMetadata) and meta.load_waits and self.connector_scheduler is not None:
            self.connector_scheduler.manager.loads_waited(meta.load_waits)
        super().update_connector_output(connector_output)

    def register_kv_caches(self, kv_caches: Any) -> None:
        """vLLM's worker start (worker thread): as `OffloadingConnector`; then a transfer that
        fails itself becomes load errors and unkept blocks instead of failing vLLM's worker
        (`tiering.integrations.vllm`, ``_Worker``), since this connector reports load errors."""
        super().register_kv_caches(kv_caches)
        worker = self.connector_worker.worker if self.connector_worker is not None else None
        if worker is not None and hasattr(worker, "recover_failed_transfers"):
            worker.recover_failed_transfers = True

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The GPU blocks this worker's loads left unwritten since the last call, their
        promotion having failed: vLLM recomputes them (worker thread)."""
        worker = self.connector_worker.worker if self.connector_worker is not None else None
        return worker.take_load_errors() if worker is not None else set()
