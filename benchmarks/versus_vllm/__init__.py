"""Ours beside vLLM 0.33's own KV offloading, under one driver: the comparison docs/results.md
quotes, rerunnable from this repository.

- `tree`: fetches the pinned vLLM wheel with pip (``--no-deps``: nothing else is
  downloaded), unzips its pure-Python ``vllm/v1/kv_offload`` package unchanged, and stands in
  for the vLLM internals it imports that no measured call reaches (a logger, config types);
- `sched`: the scheduler-thread cost of each manager call, one side per child process;
- `files`: the file tier's GB/s against a raw pool, one side per child process;
- `overload`: stores offered beyond what a file tier writes, one side per child process;
- ``python -m tiering.benchmarks.versus_vllm sched|files|overload`` (`__main__`): runs the sides
  interleaved and prints ours over vLLM's.

Thread: a command-line tool; each side runs in a child process of its own.
"""
