"""The scheduler-facing engine: the CPU tier and the secondary tiers behind one
`OffloadingManager`.

- `manager`: `TieringOffloadingManager`: the contract's methods, composing the three below;
- `promotions`: `Promotions`, blocks a lookup found in a secondary tier, loaded into the CPU tier;
- `cascades`: `Cascades`, stored blocks copied to the secondary tiers (write-back, retained writes);
- `jobs`: `JobTable`, the jobs in flight, how their ends are heard of, their deadlines;
- `admission`: `TierAdmission`, which cascades a tier gets (bound, shedding, reuse filter,
  write-back, retention);
- `recompute`: `RecomputeGate`, a promotion only when loading beats recomputing;
- `tier_calls`: calling a tier's optional hooks, its exceptions logged, never raised;
- `lookups`: `RequestLookups`, blocks counted once per request, hits by the tier that served them;
- `timeline`: `RequestTimeline`, the request log (a line per request);
- `metrics`: the Prometheus exporter of the engine's stats.

Thread: the scheduler thread (the exporter serves from a thread of its own). Imports:
`tiering.contract`, `tiering.eviction`, `tiering.cpu`, `tiering.tiers`, `tiering.errors`,
`tiering.options`, `tiering.stats`.
"""
