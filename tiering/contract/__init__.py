"""The contracts everything else is written against: what a scheduler calls and what it
gets back.

- `keys`: `OffloadKey` (a block hash and its KV-cache group), `ReqContext` (a request as the
  engine sees it);
- `mediums`: load/store specs (CPU rows, GPU blocks), `PrepareStoreOutput`, `OffloadingEvent`;
- `offloading`: `OffloadingManager`, the scheduler-facing contract (vLLM's ``kv_offload``).

Thread: none of its own (plain data and abstract classes). Imports: nothing of `tiering`
but `tiering.errors`.
"""
