"""`KVTieringConnector`: vLLM's `OffloadingConnector` with loads ready one step sooner.

Under vLLM's own connector a hit costs two engine steps before the request computes. In
step N the scheduler submits the load and parks the request (``WAITING_FOR_REMOTE_KVS``);
the worker starts the load after step N's forward and polls it at once (still copying);
it reports the load after step N+1's forward; the request computes in step N+2. A request
whose prefix is in vLLM's own cache computes in step N. Each step waited is a forward of
the rest of the batch: milliseconds on an idle server, a prefill chunk (100+ ms on CPU)
on a busy one.

This connector removes one of the two steps and keeps vLLM's protocol:

- a step that carries loads is marked ``has_sync_kv_loads``, so the worker starts them
  before the forward, where they overlap it (vLLM's HiSparse connector does the same);
- after the forward, the worker waits for that step's loads (already done, unless the
  copy took longer than the forward), so the scheduler hears of them at the end of step N
  and computes the request in step N+1.

The last step is vLLM's: its offloading scheduler plans a load on blocks it has not
cached yet, which holds only for asynchronous loads; a load that feeds the very step
that scheduled it needs a scheduler-side connector of our own (README, "Use with vLLM").

A block found only in a secondary tier costs no extra step either. Under vLLM's connector
its lookup answers "pending" until the promotion has landed in the CPU tier and the
scheduler noticed, steps later; here it answers "hit" in the step the promotion starts
(`TieringOffloadingManager.answer_pending_hits`), and that step's load waits for the rows
in the worker (`tiering.row_states`). If the promotion fails, or takes longer than
`tiering.cpu_gpu.PROMOTION_WAIT_S`, the load leaves those GPU blocks unwritten and the
connector reports them as load errors (`get_block_ids_with_load_errors`): vLLM recomputes
them, so a failed promotion costs the prefill it would have saved, never wrong output. That
needs vLLM's ``kv_load_failure_policy`` at ``"recompute"``: the connector sets it (and says
so in the log) where it is vLLM's default ``"fail"``, which would fail the request instead.

It also tells the engine each request's ``cache_salt``, which is the request's tenant
(`tiering.tenants`); under vLLM's own connector every request is the default tenant.

Use it in place of ``OffloadingConnector``; the extra config is the same, with this
engine's spec as the default::

    kv_transfer_config={"kv_connector": "KVTieringConnector",
        "kv_connector_module_path": "tiering.integrations.vllm_connector",
        "kv_role": "kv_both", "kv_connector_extra_config": {"cpu_bytes_to_use": 8 << 30}}

Thread: vLLM's scheduler thread builds the metadata; each worker's thread runs the rest.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from vllm.config import set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

from tiering.integrations import VLLM_SPEC

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


class KVTieringConnector(OffloadingConnector):
    """`OffloadingConnector` whose loads start before the forward of the step that carries
    them and are reported at its end (see the module docstring). Constructed by vLLM, once
    per role and process; raises what `OffloadingConnector` and the spec raise."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any):
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        for key, value in VLLM_SPEC.items():
            extra.setdefault(key, value)
        transfer = vllm_config.kv_transfer_config
        if transfer.kv_load_failure_policy != "recompute":
            logger.info(
                "KVTieringConnector: kv_load_failure_policy %r -> 'recompute': a block whose promotion fails is "
                "recomputed, never loaded (see tiering.integrations.vllm_connector)",
                transfer.kv_load_failure_policy,
            )
            transfer.kv_load_failure_policy = "recompute"
        with set_current_vllm_config(vllm_config):  # the spec reads the step's token budget on both sides
            super().__init__(vllm_config, role, kv_cache_config)
        if self.connector_scheduler is not None:
            self.connector_scheduler.manager.manager.answer_pending_hits = True
        self._load_waits: dict[str, float] = {}  # request id -> seconds, until the step's metadata carries them

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
        """vLLM's metadata; a step with loads starts them before its forward."""
        metadata = super().build_connector_meta(scheduler_output)
        if metadata.load_jobs:
            scheduler_output.has_sync_kv_loads = True
        return metadata

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """vLLM's report of finished transfers: (request ids done sending, done receiving),
        after waiting for this step's loads (blocks the worker thread for as long as a copy
        outlasts the forward). Raises what vLLM's worker raises (a failed transfer)."""
        assert self.connector_worker is not None and self.connector_worker.worker is not None
        assert isinstance(self._connector_metadata, OffloadingConnectorMetadata)
        if self._connector_metadata.load_jobs:
            self.connector_worker.worker.wait(set(self._connector_metadata.load_jobs))
        requests = dict(self.connector_worker._load_jobs)  # job -> request, forgotten by vLLM's get_finished
        finished = super().get_finished(finished_req_ids)
        for job_id, seconds in self.connector_worker.worker.take_load_waits().items():
            if job_id in requests:
                self._load_waits[requests[job_id]] = seconds
        return finished

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

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The GPU blocks this worker's loads left unwritten since the last call, their
        promotion having failed: vLLM recomputes them (worker thread)."""
        worker = self.connector_worker.worker if self.connector_worker is not None else None
        return worker.take_load_errors() if worker is not None else set()
