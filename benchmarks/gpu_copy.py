"""GPU<->CPU handler GB/s against one large ``copy_`` of the same bytes on the same device.

For each offloaded-block size it builds a KV cache of `--layers` tensors holding
`--total-mib` of blocks, and times, best of `--repeats`:

- store (GPU->CPU), load (CPU->GPU), and both at once (half the blocks each way), as
  transfers of `--job-blocks` blocks through `CpuGpuOffloadingHandlers`, block ids shuffled
  as a paged cache hands them out;
- baseline: one ``copy_`` of a contiguous tensor of the same total size between the same
  two memories (pinned host memory under CUDA), in each direction: stores are compared with
  device-to-host, loads with host-to-device, both at once with the mean of the two (the two
  directions differ on a GPU, by up to a tenth). On the CPU device also one ``copy_`` on one
  thread: the handlers copy on one thread per direction, chosen so that copies do not take the
  model's cores, so that is the like-for-like baseline for one direction.

Both sides copy into memory touched once before timing (first touch is slow on VMs).

Runs on CUDA when present, else on the CPU device (host memory on both sides).

    python -m tiering.benchmarks.gpu_copy --total-mib 256
"""

from __future__ import annotations

import argparse
import time

import torch
from rich.table import Table

from tiering import CpuGpuOffloadingHandlers, CPULoadStoreSpec, GPULoadStoreSpec, canonicalize_kv_caches
from tiering.benchmarks.args import format_size, sizes_arg
from tiering.benchmarks.json_report import add_json_argument, open_report


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_handlers(device: torch.device, block_bytes: int, total_bytes: int, layers: int, job_blocks: int) -> dict:
    num_blocks = max(total_bytes // block_bytes, 2 * job_blocks)
    page = block_bytes // layers
    caches = canonicalize_kv_caches(
        [torch.randint(-128, 127, (num_blocks, page), dtype=torch.int8, device=device) for _ in range(layers)],
        num_blocks,
    )
    handlers = CpuGpuOffloadingHandlers(caches, 1, num_blocks)
    generator = torch.Generator().manual_seed(0)
    gpu_ids = torch.randperm(num_blocks, generator=generator).tolist()
    cpu_ids = torch.randperm(num_blocks, generator=generator).tolist()
    jobs = [(gpu_ids[i : i + job_blocks], cpu_ids[i : i + job_blocks]) for i in range(0, num_blocks, job_blocks)]

    def run(plan):
        job_ids = []
        _sync(device)
        start = time.perf_counter()
        for job_id, (handler, gpu, cpu) in enumerate(plan):
            gpu_spec, cpu_spec = GPULoadStoreSpec(gpu, [len(gpu)], [0]), CPULoadStoreSpec(cpu)
            spec = (gpu_spec, cpu_spec) if handler is handlers.gpu_to_cpu_handler else (cpu_spec, gpu_spec)
            assert handler.transfer_async(job_id, spec)
            job_ids.append(job_id)
        for handler in (handlers.gpu_to_cpu_handler, handlers.cpu_to_gpu_handler):
            handler.wait(job_ids)
        seconds = time.perf_counter() - start
        results = handlers.gpu_to_cpu_handler.get_finished() + handlers.cpu_to_gpu_handler.get_finished()
        assert len(results) == len(plan) and all(r.success for r in results)
        return seconds

    store, load = handlers.gpu_to_cpu_handler, handlers.cpu_to_gpu_handler
    try:
        run([(store, gpu, cpu) for gpu, cpu in jobs])  # touch every CPU page once, untimed
        half = len(jobs) // 2
        return {
            "store": run([(store, gpu, cpu) for gpu, cpu in jobs]),
            "load": run([(load, gpu, cpu) for gpu, cpu in jobs]),
            "both": run([(store, *jobs[i]) for i in range(half)] + [(load, *jobs[i]) for i in range(half, 2 * half)]),
            "bytes": num_blocks * page * layers,
            "both bytes": 2 * half * job_blocks * page * layers,
        }
    finally:
        handlers.shutdown()


def time_baseline(device: torch.device, nbytes: int, threads: int, to_host: bool) -> float:
    """Seconds of one copy_ of `nbytes` from device memory to (pinned) host memory if
    `to_host`, else back, with torch running on `threads` intra-op threads (which matters on
    the CPU device only)."""
    pinned = device.type == "cuda"
    on_device = torch.randint(-128, 127, (nbytes,), dtype=torch.int8, device=device)
    on_host = torch.ones(nbytes, dtype=torch.int8, pin_memory=pinned)
    source, target = (on_device, on_host) if to_host else (on_host, on_device)
    target.copy_(source)  # first touch of fresh memory is slow on VMs: keep it out of the timing
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _sync(device)
        start = time.perf_counter()
        target.copy_(source, non_blocking=True)
        _sync(device)
        return time.perf_counter() - start
    finally:
        torch.set_num_threads(previous)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--block-sizes", type=sizes_arg, default="64KiB,256KiB,1MiB,2MiB,8MiB", help="comma-separated (%(default)s)"
    )
    parser.add_argument("--total-mib", type=int, default=256, help="bytes moved per measurement (default 256 MiB)")
    parser.add_argument("--layers", type=int, default=8, help="KV tensors per block (default 8)")
    parser.add_argument("--job-blocks", type=int, default=16, help="blocks per transfer (default 16)")
    parser.add_argument("--repeats", type=int, default=3, help="runs; the best is kept (default 3)")
    add_json_argument(parser)
    args = parser.parse_args(argv)
    report, values = open_report(parser, args, "gpu_copy", argv), {}
    if any(size % args.layers for size in args.block_sizes):
        parser.error(f"--block-sizes: each must split into --layers {args.layers} equal pages")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    threads = torch.get_num_threads()
    baselines = {"out": (threads, True), "in": (threads, False)} | ({"out1": (1, True)} if device.type == "cpu" else {})
    table = Table(title=f"Handlers vs one copy_ on {device} ({args.layers} tensors, best of {args.repeats})")
    columns = ["block", "store / load / both GB/s", "one copy_ out / in GB/s", "vs it"]
    if "out1" in baselines:
        columns += ["copy_ on 1 thread", "vs it"]
    for column in columns:
        table.add_column(column, justify="left" if column == "block" else "right")
    for size in args.block_sizes:
        runs = []
        for _ in range(args.repeats + 1):
            run = time_handlers(device, size, args.total_mib << 20, args.layers, args.job_blocks)
            for key, (count, to_host) in baselines.items():
                run[key] = time_baseline(device, int(run["bytes"]), count, to_host)
            runs.append(run)
        values[size] = runs = runs[1:]  # the first round only warms allocations up
        best = {key: min(run[key] for run in runs) for key in ("store", "load", "both", *baselines)}
        rates = {key: runs[0]["bytes"] / best[key] / 1e9 for key in ("store", "load", *baselines)}
        rates["both"] = runs[0]["both bytes"] / best["both"] / 1e9
        versus = {"store": rates["out"], "load": rates["in"], "both": (rates["out"] + rates["in"]) / 2}
        row = [format_size(size), " / ".join(f"{rates[key]:.2f}" for key in versus)]
        row.append(f"{rates['out']:.2f} / {rates['in']:.2f}")
        row.append(" / ".join(f"{rates[key] / versus[key]:.2f}x" for key in versus))
        if "out1" in baselines:
            row += [
                f"{rates['out1']:.2f}",
                " / ".join(f"{rates[key] / rates['out1']:.2f}x" for key in ("store", "load")),
            ]
        table.add_row(*row)
    report.print(table, values)
    report.write()


if __name__ == "__main__":
    main()
