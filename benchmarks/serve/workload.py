"""Token prompts from a Mooncake trace, for a real model.

Each block id of the trace becomes `tokens_per_id` tokens drawn from a generator seeded by
the id, so equal ids give equal tokens and requests that share leading ids share a prefix,
as in the trace. Tokens are ``2 .. vocab - 1`` (the local tokenizer's ``w0`` and ``w1`` are
its unknown and end-of-sequence tokens).
"""

from __future__ import annotations

import random

from tiering.benchmarks.loadgen.workload import Request


def conversations(requests: list[Request], shared_ids: int = 1) -> list[int]:
    """Each request's conversation, numbered in order of its first request. A conversation
    is the requests that share their first `shared_ids` + 1 block ids (a chat resends the
    conversation so far), `shared_ids` being the ids every conversation starts with: one in
    the Mooncake trace, the system prompt's `HOT_SYSTEM_BLOCKS` in ``hot-prefix``."""
    numbers: dict[tuple[int, ...], int] = {}
    return [numbers.setdefault(request.hash_ids[: shared_ids + 1], len(numbers)) for request in requests]


def sample_conversations(requests: list[Request], every: int, shared_ids: int = 1) -> list[Request]:
    """The requests of one conversation in `every` (`conversations` 0, `every`, 2 `every`...),
    whole: a trace thinned by session keeps each conversation's reuse and gaps, and offers
    1/`every` of the load."""
    numbers = conversations(requests, shared_ids)
    return [request for request, number in zip(requests, numbers, strict=True) if number % every == 0]


def prompts(requests: list[Request], tokens_per_id: int, max_tokens: int, vocab: int) -> list[list[int]]:
    """Token prompts of `requests`, at most `max_tokens` tokens each."""
    blocks: dict[int, list[int]] = {}
    out = []
    for request in requests:
        tokens: list[int] = []
        for block in request.hash_ids:
            if len(tokens) >= max_tokens:
                break
            if block not in blocks:
                rng = random.Random(block)
                blocks[block] = [rng.randrange(2, vocab) for _ in range(tokens_per_id)]
            tokens.extend(blocks[block])
        out.append(tokens[:max_tokens])
    return out


def reusable_prefix_tokens(token_prompts: list[list[int]], block_tokens: int) -> list[int]:
    """For each prompt, the tokens of its leading full blocks of `block_tokens` that an
    earlier prompt had too: what any prefix cache large enough could serve it."""
    seen: set[int] = set()
    out = []
    for tokens in token_prompts:
        chain, prefixes = 0, []  # a hash of each leading run of blocks, as a prefix cache keys them
        for end in range(block_tokens, len(tokens) + 1, block_tokens):
            chain = hash((chain, *tokens[end - block_tokens : end]))
            prefixes.append(chain)
        shared = 0
        while shared < len(prefixes) and prefixes[shared] in seen:
            shared += 1
        out.append(shared * block_tokens)
        seen.update(prefixes)
    return out
