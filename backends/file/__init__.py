"""The ``file`` tier: blocks in a local directory, one file per block or many per segment file
(see `tiering.backends.file.store` for the layout, the safety rules and the I/O modes).

- `store`: `FileBlockStore`, the `BlockStore` (its coroutines); `options` its config keys
  (`FileOptions`, `check_root_dir`);
- `dirs`: the namespace directory and its shards, opened once; who holds what;
- `objects`: one file per block: writes, reads, existence, deletes, the scan at start;
- `segments`: many blocks per segment file, `SegmentLog`; `segment_io` its files' system
  calls, `segment_fds` the descriptors it keeps open, `segment_recovery` the scan at start;
- `pool`: `DaemonThreadPool`, the threads the blocking calls run on.

Thread: `store`'s coroutines on the tier's loop; everything else on the pool's threads (one
hop per block or batch). Imports: `tiering.contract`, `tiering.tiers`, `tiering.errors`,
`tiering.options`, and `tiering.backends.buffers`.
"""

from tiering.backends.file.options import FileOptions, check_root_dir
from tiering.backends.file.store import FileBlockStore

__all__ = ["FileBlockStore", "FileOptions", "check_root_dir"]
