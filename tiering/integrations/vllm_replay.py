"""Replay a Mooncake trace through a real vLLM running this engine (the ``vllm`` extra).

    python -m tiering.integrations.vllm_replay --model DIR --config engine.yaml \\
        --trace conversation_trace.jsonl --max-requests 200 --output replay.json

The numbers come from the code vLLM runs: `KVTieringOffloadingSpec` behind the engine's
`KVTieringConnector` (vLLM's `OffloadingConnector`, with loads a step sooner), with vLLM's
own scheduler and prefix cache in front. Each block id of the trace becomes
``--tokens-per-id`` deterministic tokens (so equal ids share a prefix, as in the trace), a
prompt is cut to fit the model, and each request generates ``--max-tokens`` tokens, one
request after the other. Reported: prompt tokens, tokens vLLM found cached (its own prefix
cache and this engine together), vLLM's ``kv_offload`` byte counters, and the engine's
stats.

Thread: a command-line tool; the main thread drives vLLM.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tiering.benchmarks.loadgen.workload import read_trace
from tiering.benchmarks.serve.workload import prompts
from tiering.integrations import VLLM_CONNECTOR
from tiering.integrations.vllm import live_specs

COUNTERS = (
    "vllm:kv_offload_store_bytes",
    "vllm:kv_offload_load_bytes",
    "vllm:prefix_cache_hits",
    "vllm:external_prefix_cache_hits",
)


def replay(llm: Any, token_prompts: list[list[int]], max_tokens: int = 1) -> dict[str, Any]:
    """Generate for each prompt in turn; returns the report (see the module docstring)."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    prompt_tokens = cached_tokens = 0
    for tokens in token_prompts:
        (output,) = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)
        prompt_tokens += len(tokens)
        cached_tokens += output.num_cached_tokens or 0
    metrics = {m.name: m.value for m in llm.get_metrics() if m.name in COUNTERS and hasattr(m, "value")}
    managers = [spec.engine.manager for spec in live_specs() if spec.engine.manager is not None]
    return {
        "requests": len(token_prompts),
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached_tokens,
        "cached_fraction": cached_tokens / prompt_tokens if prompt_tokens else 0.0,
        "vllm": metrics,
        "engine": managers[0].get_stats() if managers else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tiering.integrations.vllm_replay", description=__doc__)
    parser.add_argument("--model", required=True, help="a model directory or name vLLM can load")
    parser.add_argument("--config", type=Path, required=True, help="the engine's YAML (as for tiering-bench)")
    parser.add_argument("--trace", type=Path, required=True, help="Mooncake JSONL trace")
    parser.add_argument("--max-requests", type=int, default=200)
    parser.add_argument("--tokens-per-id", type=int, default=32, help="tokens of one trace block id")
    parser.add_argument("--block-size", type=int, default=32, help="vLLM's block size, tokens")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=1, help="tokens generated per request")
    parser.add_argument("--output", type=Path, help="write the report as JSON")
    args = parser.parse_args(argv)

    from vllm import LLM

    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        enforce_eager=True,
        disable_log_stats=False,
        kv_transfer_config={**VLLM_CONNECTOR, "kv_connector_extra_config": {"config_file": str(args.config)}},
    )
    vocab = llm.llm_engine.model_config.get_vocab_size()
    requests = read_trace(args.trace, args.max_requests)
    limit = args.max_model_len - args.max_tokens
    report = replay(llm, prompts(requests, args.tokens_per_id, limit, vocab), args.max_tokens)
    text = json.dumps(report, indent=2, default=str)
    print(text)
    if args.output:
        args.output.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
