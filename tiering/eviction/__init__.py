"""What goes first when a tier is full: the policies that rank a tier's blocks, the
frequency sketch some of them learn from, and the retention clients ask for.

- `base`: `CachePolicy`, the interface, and the registry of policies by name;
- `lru`, `arc`, `arc_s`: the policies, one module each; `policies` registers them all;
- `sketch`: `CountMinSketch`, counts of keys in fixed memory (ARC-S, admission's reuse filter);
- `retention`: requests' retain/release hints and the soft deadlines they give blocks (the
  CPU tier, its tenants, and the block-store tiers' index keep them).

Thread: the scheduler thread (the tier that owns each object). Imports: `tiering.contract`.
"""
