"""The scheduler-facing engine: the CPU tier and the secondary tiers behind one
`OffloadingManager`.

- `manager`: `TieringOffloadingManager`: lookups, promotions, cascades, write-back, jobs;
- `jobs`: the records of its work (jobs in flight, deadlines, promotions queued);
- `tier_calls`: calling a tier's optional hooks, its exceptions logged, never raised;
- `lookups`: `RequestLookups`, blocks counted once per request, hits by the tier that served them;
- `timeline`: `RequestTimeline`, the request log (a line per request);
- `metrics`: the Prometheus exporter of the engine's stats.

Thread: the scheduler thread (the exporter serves from a thread of its own). Imports:
`tiering.contract`, `tiering.eviction`, `tiering.cpu`, `tiering.tiers`, `tiering.errors`,
`tiering.options`, `tiering.stats`.
"""
