"""The CPU primary tier: the only tier that talks to the GPU, its rows in shared memory.

- `manager`: `CPUOffloadingManager`: keys to rows, ref counts, stores and loads;
- `primary`: `CPUPrimaryTierOffloadingManager`: the same over a shared region, serving the
  secondary tiers' cascades (reads) and promotions (writes);
- `rows`: `Rows`, free rows, quarantined ones, and rows a load pinned before their
  promotion landed;
- `refusals`: `Refusals`, reservations that found no row, counted by reason and traced;
- `order`: `EvictionOrder`, what goes first in a tier without tenants (one policy and the
  retention deadlines);
- `tenants`: tenants' shares of the rows, per-tenant eviction and counters (the same calls
  as `order`);
- `request_access`: a request's blocks, ranked in prefix order when it finishes;
- `shared_region`: `SharedOffloadRegion`, the rows in one ``/dev/shm`` file shared with the
  worker processes;
- `row_states`: a byte per row, whether its promotion landed (loads that wait for it).

Thread: the scheduler thread (`shared_region` and `row_states` are also mapped by the
workers). Imports: `tiering.contract`, `tiering.eviction`, `tiering.errors`, `tiering.options`,
`tiering.stats`.
"""
