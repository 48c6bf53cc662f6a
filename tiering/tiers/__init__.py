"""The secondary tiers: their contract, how they are built and run, and the stored format.
(What the engine decides about them, admission and the recompute gate, is `tiering.engine`'s;
a block-store tier's health, `tiering.tiers.blockstore`'s.)

- `base`: `SecondaryTierManager`, `JobMetadata`, `JobResult`, `Doorbell`: the tier contract;
- `context`: `TierContext`, what a tier gets from the engine, and tier names;
- `factory`: `SecondaryTierFactory`, the one registry of tier types;
- `runtime`: `AsyncRuntime`, the event loop thread the tiers share;
- `object_format`: a stored block: header (key, layout, length, XXH3-64 or seal) and payload;
- `seal`: integrity keys, signing and encrypting objects (AES-256-GCM);
- `blockstore/`: block-store tiers (any `BlockStore` becomes a tier).

Threads: the scheduler thread calls every tier method; `runtime`'s loop thread runs the
stores' coroutines. Imports: `tiering.contract`, `tiering.eviction`, `tiering.cpu.row_states`,
`tiering.errors`, `tiering.options`, `tiering.stats`.
"""
