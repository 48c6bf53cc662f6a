"""The worker side: moving blocks between the paged GPU KV cache and the CPU tier's rows.

- `cpu_gpu`: `CpuGpuOffloadingHandlers`, a worker's two handlers (how each device copies);
- `direction`: one direction's FIFO of transfers, on a CUDA stream or a host thread;
- `transfers`: `TransferResult`, `OffloadingHandler`, a job's plan of page copies;
- `batch_copy`: a job as one batch of pointer copies (one driver call, or memmoves);
- `copy_kernel`: a batch of small copies as one GPU kernel launch (Triton);
- `copiers`: which of those a CUDA worker uses;
- `canonical`: KV tensors as pages.

Thread: the worker processes' (a copy thread or CUDA stream per direction). Needs torch.
Imports: `tiering.contract`, `tiering.cpu.row_states`.
"""
