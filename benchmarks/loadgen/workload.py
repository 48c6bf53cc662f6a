"""Requests to replay: a Mooncake trace, or a synthetic workload.

A request is a list of prefix block ids (equal ids are the same KV block, whose prefix is
the same too) of `BLOCK_TOKENS` tokens each, the last one possibly partial.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

BLOCK_TOKENS = 512  # tokens per block id in the Mooncake traces
WORKLOADS = ("multi-turn", "long-doc", "zipf")


@dataclass(frozen=True)
class Request:
    """One request: arrival in milliseconds from the first, prompt and output tokens, and
    the ids of its prompt's blocks."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def block_tokens(self) -> list[int]:
        """Tokens of each block: full blocks, then the remainder of the prompt."""
        last = self.input_length - BLOCK_TOKENS * (len(self.hash_ids) - 1)
        return [BLOCK_TOKENS] * (len(self.hash_ids) - 1) + [max(1, min(last, BLOCK_TOKENS))]


def read_trace(path: str | Path, max_requests: int | None = None) -> list[Request]:
    """Requests of a Mooncake JSONL trace (``timestamp`` ms, ``input_length``,
    ``output_length``, ``hash_ids``), in file order.

    Raises:
        ValueError: a line is not a JSON object with those fields (the message names the line).
    """
    requests = []
    with open(path) as lines:
        for number, line in enumerate(itertools.islice(lines, max_requests), start=1):
            try:
                record = json.loads(line)
                requests.append(
                    Request(
                        float(record["timestamp"]),
                        int(record["input_length"]),
                        int(record["output_length"]),
                        tuple(int(block) for block in record["hash_ids"]),
                    )
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{number}: not a trace record ({exc!r})") from None
    return requests


def synthetic(name: str, num_requests: int, seed: int = 0) -> list[Request]:
    """`num_requests` requests of a built-in workload, deterministic for a seed.

    - ``multi-turn``: chats that share a few system prompts; each turn resends the
      conversation so far plus a new message.
    - ``long-doc``: questions about long documents, documents picked by a Zipf law.
    - ``zipf``: prompts whose prefixes are drawn from a Zipf-distributed pool.

    Raises:
        ValueError: unknown workload name.
    """
    generators = {"multi-turn": _multi_turn, "long-doc": _long_doc, "zipf": _zipf}
    if name not in generators:
        raise ValueError(f"unknown workload {name!r}; known workloads: {', '.join(WORKLOADS)}")
    rng = np.random.default_rng(seed)
    ids = itertools.count()
    blocks = list(itertools.islice(generators[name](rng, ids), num_requests))
    gaps = rng.exponential(250.0, size=len(blocks))  # ~4 requests per second
    times = np.cumsum(gaps) - gaps[0]
    return [
        Request(float(t), BLOCK_TOKENS * len(b) - int(rng.integers(0, BLOCK_TOKENS)), 256, tuple(b))
        for t, b in zip(times, blocks, strict=True)
    ]


def _multi_turn(rng: np.random.Generator, ids: Iterator[int]) -> Iterator[list[int]]:
    system_prompts = [[next(ids) for _ in range(int(rng.integers(2, 6)))] for _ in range(4)]
    chats: list[list[int]] = []
    while True:
        if not chats or (len(chats) < 24 and rng.random() < 0.3):
            chats.append(list(system_prompts[int(rng.integers(len(system_prompts)))]))
        chat = chats[int(rng.integers(len(chats)))]
        chat.extend(next(ids) for _ in range(int(rng.integers(1, 4))))
        yield list(chat)
        if len(chat) > 40:
            chats.remove(chat)


def _long_doc(rng: np.random.Generator, ids: Iterator[int]) -> Iterator[list[int]]:
    documents = [[next(ids) for _ in range(int(rng.integers(8, 32)))] for _ in range(64)]
    while True:
        document = documents[min(int(rng.zipf(1.3)) - 1, len(documents) - 1)]
        yield [*document, next(ids)]


def _zipf(rng: np.random.Generator, ids: Iterator[int]) -> Iterator[list[int]]:
    prefixes = [[next(ids) for _ in range(int(rng.integers(1, 12)))] for _ in range(512)]
    while True:
        prefix = prefixes[min(int(rng.zipf(1.2)) - 1, len(prefixes) - 1)]
        yield [*prefix, *(next(ids) for _ in range(int(rng.integers(1, 4))))]
