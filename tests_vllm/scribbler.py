"""A test-only tier that loads wrong bytes: once a promotion has passed every check, it
overwrites the promoted rows with noise. The negative control of the vLLM stage."""

import numpy as np

from tiering import BlockStoreTier
from tiering.backends import MemoryBlockStore


class ScribblingTier(BlockStoreTier):
    def __init__(self, offloading_spec, primary_kv_view, tier_type="scribbler"):
        super().__init__(offloading_spec, primary_kv_view, tier_type, MemoryBlockStore)
        self._rows = np.asarray(self.context.primary_rows).view(np.uint8)
        self._rows_of_job: dict[int, list[int]] = {}
        self._noise = np.random.default_rng(0)

    def submit_load(self, job_metadata):
        self._rows_of_job[job_metadata.job_id] = [int(row) for row in job_metadata.block_ids]
        super().submit_load(job_metadata)

    def get_finished(self):
        results = super().get_finished()
        for result in results:
            for row in self._rows_of_job.pop(result.job_id, ()):
                if result.success:
                    self._rows[row] = self._noise.integers(0, 256, self._rows.shape[1], dtype=np.uint8)
        return results
