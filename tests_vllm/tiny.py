"""A tiny Llama made locally (no downloads) and a vLLM engine over it, for the vLLM stage."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from tiering.integrations import VLLM_CONNECTOR, VLLM_SPEC

BLOCK = 32  # tokens per vLLM block (a multiple of 32 on the CPU attention backend)


def make_model(
    directory: Path,
    layer_types: list[str] | None = None,
    sliding_window: int | None = None,
    architecture: str = "llama",
) -> Path:
    """Save the 2-layer Llama (and its tokenizer) the vLLM stage runs; with `layer_types`,
    its layers' attention kinds, and `architecture` (see
    `tiering.benchmarks.serve.model.make_model`)."""
    from tiering.benchmarks.serve.model import make_model as make

    return make(
        directory, max_len=2048, layer_types=layer_types, sliding_window=sliding_window, architecture=architecture
    )


def make_llm(
    model: Path,
    extra_config: dict | None = None,
    connector: str = "OffloadingConnector",
    engine_id: str | None = None,
    **kwargs,
):
    """vLLM's offline engine over `model`; with `extra_config`, this engine behind
    `connector` (vLLM's ``OffloadingConnector`` or this engine's ``KVTieringConnector``),
    its shared-memory region named by `engine_id` (None: vLLM draws one)."""
    from vllm import LLM

    options = {
        "model": str(model),
        "skip_tokenizer_init": True,
        "dtype": "float32",
        "enforce_eager": True,
        "block_size": BLOCK,
        "max_model_len": 1024,
        "seed": 0,
        "distributed_executor_backend": "uni",
        "gpu_memory_utilization": 0.5,
    }
    if extra_config is not None:
        options["kv_transfer_config"] = {
            **VLLM_CONNECTOR,
            "kv_connector": connector,
            "kv_connector_extra_config": {**VLLM_SPEC, **extra_config},
            **({} if engine_id is None else {"engine_id": engine_id}),
        }
    options.update(kwargs)
    return LLM(**options)


def generate(
    llm, prompts: list[list[int]], max_tokens: int = 8, cache_salt: str | None = None, kv_transfer_params=None
):
    """(token ids, logprobs of the chosen tokens, cached prompt tokens) per prompt, greedy;
    `cache_salt`: the prompts' salt (their tenant), or None; `kv_transfer_params`: the
    requests' (as the OpenAI server passes a request body's), or None."""
    from vllm import SamplingParams, TokensPrompt

    extra = None if kv_transfer_params is None else {"kv_transfer_params": kv_transfer_params}
    params = SamplingParams(
        temperature=0, max_tokens=max_tokens, logprobs=0, ignore_eos=True, detokenize=False, extra_args=extra
    )
    salt = {} if cache_salt is None else {"cache_salt": cache_salt}
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p, **salt) for p in prompts], params, use_tqdm=False)
    results = []
    for out in outputs:
        completion = out.outputs[0]
        chosen = [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids, strict=True)]
        results.append((list(completion.token_ids), chosen, out.num_cached_tokens or 0))
    return results


def settle(llm, done, tries: int = 300) -> None:
    """Keep vLLM stepping (a prompt too short to store anything) until ``done()`` holds:
    GPU stores and cascades finish after `generate` returns."""
    for _ in range(tries):
        if done():
            return
        generate(llm, [[7] * 8], max_tokens=1)
    raise AssertionError("the engine did not settle")


def block_files(root: Path) -> list[Path]:
    """Every file of a file tier's `root` but those of identities' records (a namespace that
    holds a manifest: `tiering.tiers.blockstore.generations`) and of engines' leases (one that
    holds a lease: `tiering.tiers.blockstore.leases`)."""
    from tiering.backends.file.dirs import object_name
    from tiering.tiers.blockstore.generations import MANIFEST_KEY
    from tiering.tiers.blockstore.leases import LEASE_PREFIX

    records = {path.parents[1] for path in root.rglob(object_name(MANIFEST_KEY))}
    records |= {path.parents[1] for path in root.rglob(f"{LEASE_PREFIX.hex()}*")}
    return sorted(path for path in root.rglob("*") if path.is_file() and not records & set(path.parents))


def object_pages(root: Path) -> list[tuple[Path, int]]:
    """(file, offset) of every stored block's header under a file tier's `root`, in either
    layout: a header fills a page of its own and starts with the object format's magic."""
    from tiering.backends.file.objects import ALIGN
    from tiering.tiers.object_format import MAGIC

    found = []
    for path in block_files(root):
        data = path.read_bytes()
        found += [(path, at) for at in range(0, len(data), ALIGN) if data[at : at + len(MAGIC)] == MAGIC]
    return found


def corrupt_payloads(root: Path) -> None:
    """Flip the first byte of every page under a file tier's `root` that is not an object's
    header: every payload changes, every header stays valid (either layout)."""
    from tiering.backends.file.objects import ALIGN

    headers = set(object_pages(root))
    for path in block_files(root):
        data = bytearray(path.read_bytes())
        for at in range(0, len(data), ALIGN):
            if (path, at) not in headers:
                data[at] ^= 0xFF
        path.write_bytes(data)
