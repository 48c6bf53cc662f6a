"""Requests to replay: a Mooncake trace, or a synthetic workload.

A request is a list of prefix block ids (equal ids are the same KV block, whose prefix is
the same too) of `BLOCK_TOKENS` tokens each, the last one possibly partial (never cached:
see `Request.full_blocks`), and the tenant it is for (None: the engine's default).
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import itertools
import json
import math
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from tiering.benchmarks.args import parse_hints

BLOCK_TOKENS = 512  # tokens per block id in the Mooncake traces
WORKLOADS = ("multi-turn", "long-doc", "zipf", "shared-prefix", "hot-prefix")
HOT_BURST, HOT_SYSTEM_BLOCKS = 24, 24  # hot-prefix: conversations per burst, blocks of their system prompt
HOT_BURST_GAP_MS, HOT_PAUSE_MS = 40.0, 10_000.0  # between a burst's requests; between bursts
REPLAY_TENANT, FLOOD_TENANT = "replay", "flood"  # the two tenants of `with_flood`


@dataclass(frozen=True)
class Request:
    """One request: arrival in milliseconds from the first, prompt and output tokens, the
    ids of its prompt's blocks of `tokens_per_block` tokens, its tenant, and the retention
    hint it sends (`tiering.eviction.retention`: ``{"retain": seconds}`` or ``{"release":
    True}``; None: none)."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    tenant: str | None = None
    hint: dict[str, Any] | None = None
    tokens_per_block: int = BLOCK_TOKENS

    def block_tokens(self) -> list[int]:
        """Tokens of each block: full blocks, then the remainder of the prompt."""
        size = self.tokens_per_block
        last = self.input_length - size * (len(self.hash_ids) - 1)
        return [size] * (len(self.hash_ids) - 1) + [max(1, min(last, size))]

    def full_blocks(self) -> int:
        """How many leading blocks hold `tokens_per_block` tokens: those a prefix cache can
        hold. vLLM hashes, and so caches and offloads, no partial block: a prompt's partial
        last block is always computed, never looked up or stored."""
        return min(len(self.hash_ids), self.input_length // self.tokens_per_block)


TRACE_FORMAT = (
    "JSON Lines, one request per line: "
    '{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [block ids, 0 <= id < 2**64]}'
)


def read_trace(path: str | Path, max_requests: int | None = None) -> list[Request]:
    """Requests of a Mooncake JSONL trace (`TRACE_FORMAT`), in file order; blank lines are
    skipped. A path ending in ``.gz`` is read through gzip (the traces shipped in ``traces/``).

    Raises:
        ValueError: the file is not a regular UTF-8 file, or a line is not a request of that
            format (the message names the line and says what is expected).
        OSError: the file cannot be read.
    """
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise ValueError(f"{path}: not a regular file (a directory or FIFO?); expected {TRACE_FORMAT}")
    requests: list[Request] = []
    with _open_text(path) as lines:
        try:
            for number, line in enumerate(lines, start=1):
                if len(requests) == max_requests:
                    break
                if line.strip():
                    requests.append(_request(line, f"{path}:{number}"))
        except UnicodeDecodeError:
            raise ValueError(f"{path}: not UTF-8 text; expected {TRACE_FORMAT}") from None
        except (gzip.BadGzipFile, EOFError) as exc:
            raise ValueError(f"{path}: not a whole gzip file ({exc}); expected {TRACE_FORMAT}, compressed") from None
    return requests


def _open_text(path: str | Path) -> TextIO:
    """`path` as UTF-8 text, through gzip when its name ends in ``.gz``."""
    if str(path).endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _request(line: str, where: str) -> Request:
    try:
        record = json.loads(line)
    except ValueError:
        raise ValueError(f"{where}: not JSON ({line[:40]!r}); expected {TRACE_FORMAT}") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a JSON {type(record).__name__}, not an object; expected {TRACE_FORMAT}")
    missing = [name for name in ("timestamp", "input_length", "output_length", "hash_ids") if name not in record]
    if missing:
        raise ValueError(f"{where}: not a trace record: {', '.join(missing)} missing; expected {TRACE_FORMAT}")
    timestamp, input_length, output_length, hash_ids = (
        record[name] for name in ("timestamp", "input_length", "output_length", "hash_ids")
    )
    if not _number(timestamp) or not math.isfinite(timestamp) or timestamp < 0:
        raise ValueError(f"{where}: timestamp {timestamp!r} is not a time in ms >= 0")
    if not _integer(input_length) or input_length < 1 or not _integer(output_length) or output_length < 0:
        lengths = f"input_length {input_length!r}, output_length {output_length!r}"
        raise ValueError(f"{where}: {lengths}: expected token counts (input >= 1, output >= 0)")
    if not isinstance(hash_ids, list) or not hash_ids:
        raise ValueError(f"{where}: hash_ids must be a non-empty list of block ids")
    bad = next((block for block in hash_ids if not _integer(block) or not 0 <= block < 1 << 64), None)
    if bad is not None:
        raise ValueError(f"{where}: block id {bad!r} is not an integer in 0 .. 2**64 - 1")
    if input_length > BLOCK_TOKENS * len(hash_ids):
        raise ValueError(f"{where}: {input_length} tokens do not fit {len(hash_ids)} blocks of {BLOCK_TOKENS}")
    return Request(float(timestamp), input_length, output_length, tuple(hash_ids))


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def synthetic(name: str, num_requests: int, seed: int = 0) -> list[Request]:
    """`num_requests` requests of a built-in workload, deterministic for a seed.

    - ``multi-turn``: chats that share a few system prompts; each turn resends the
      conversation so far plus a new message.
    - ``long-doc``: questions about long documents, documents picked by a Zipf law.
    - ``zipf``: prompts whose prefixes are drawn from a Zipf-distributed pool.
    - ``shared-prefix``: 8 prefixes of 32 blocks, each request one of them (uniformly) and
      a block of its own (the serving benchmark's hit-cost workload).
    - ``hot-prefix``: conversations that all start with one system prompt of
      `HOT_SYSTEM_BLOCKS` blocks: one request first (the prompt is then cached somewhere),
      then bursts from `HOT_PAUSE_MS` / 2 on: `HOT_BURST` new conversations' first turns
      `HOT_BURST_GAP_MS` apart, after `HOT_PAUSE_MS` their second turns, then a new burst
      (what piles onto the one replica a prefix router sends the prompt to).

    Requests arrive about 4 a second (exponential gaps), ``hot-prefix``'s in its bursts.

    Raises:
        ValueError: unknown workload name.
    """
    generators = {
        "multi-turn": _multi_turn,
        "long-doc": _long_doc,
        "zipf": _zipf,
        "shared-prefix": _shared_prefix,
        "hot-prefix": _hot_prefix,
    }
    if name not in generators:
        raise ValueError(f"unknown workload {name!r}; known workloads: {', '.join(WORKLOADS)}")
    rng = np.random.default_rng(seed)
    ids = itertools.count()
    blocks = list(itertools.islice(generators[name](rng, ids), num_requests))
    if name == "hot-prefix":
        bursts = [
            HOT_PAUSE_MS / 2 + (i // HOT_BURST) * HOT_PAUSE_MS + (i % HOT_BURST) * HOT_BURST_GAP_MS
            for i in range(len(blocks) - 1)
        ]
        times = np.array([0.0, *bursts][: len(blocks)])
    else:
        gaps = rng.exponential(250.0, size=len(blocks))  # ~4 requests per second
        times = np.cumsum(gaps) - gaps[0]
    return [
        Request(float(t), BLOCK_TOKENS * len(b) - int(rng.integers(0, BLOCK_TOKENS)), 256, tuple(b))
        for t, b in zip(times, blocks, strict=True)
    ]


CONTINUATION_TTL_S = 300.0
"""The retention a request whose conversation continues asks for under ``--hints continuation``."""


def with_hints(requests: list[Request], hints: str) -> list[Request]:
    """`requests` with the hints a client would send (`tiering.benchmarks.args.parse_hints`):
    ``continuation``, retain for `CONTINUATION_TTL_S` a request whose prompt a later request
    extends (the user is still typing: its conversation has another turn), release the others
    (the last turn); ``retain:DURATION``, every request retains; ``release``, every request
    releases; ``none``, no hint.

    Raises:
        ValueError: `hints` is not such a value.
    """
    mode, seconds = parse_hints(hints)
    if mode == "none":
        return requests
    if mode != "continuation":
        hint = {"retain": seconds} if mode == "retain" else {"release": True}
        return [dataclasses.replace(request, hint=hint) for request in requests]
    later: set[int] = set()  # a hash of every prefix of a later request's full blocks
    continues = [False] * len(requests)
    for index in range(len(requests) - 1, -1, -1):
        ids = requests[index].hash_ids[: requests[index].full_blocks()]
        prefixes = list(itertools.accumulate(ids, lambda prefix, block: hash((prefix, block)), initial=0))[1:]
        continues[index] = bool(prefixes) and prefixes[-1] in later
        later.update(prefixes)
    return [
        dataclasses.replace(request, hint={"retain": CONTINUATION_TTL_S} if go_on else {"release": True})
        for request, go_on in zip(requests, continues, strict=True)
    ]


def in_blocks_of(requests: list[Request], tokens: int) -> list[Request]:
    """`requests` (blocks of `BLOCK_TOKENS`, a trace's) in blocks of `tokens`, a divisor of
    it, as an engine of that block size sees them: each block id becomes ``BLOCK_TOKENS //
    tokens`` ids (the same ones wherever the block recurs, so prefixes share as in the
    trace), up to the prompt's last token.

    Raises:
        ValueError: `tokens` does not divide `BLOCK_TOKENS`.
    """
    if tokens < 1 or BLOCK_TOKENS % tokens:
        raise ValueError(
            f"block_size {tokens}: the replay's blocks are {BLOCK_TOKENS} tokens; expected a divisor of it"
        )
    if tokens == BLOCK_TOKENS:
        return requests
    pieces = BLOCK_TOKENS // tokens
    split: dict[int, tuple[int, ...]] = {}

    def ids_of(block: int) -> tuple[int, ...]:
        if block not in split:
            head = block.to_bytes(8, "big")
            split[block] = tuple(
                int.from_bytes(hashlib.blake2b(head + i.to_bytes(2, "big"), digest_size=8).digest(), "big")
                for i in range(pieces)
            )
        return split[block]

    out = []
    for request in requests:
        ids = [piece for block in request.hash_ids for piece in ids_of(block)]
        count = -(-request.input_length // tokens)
        out.append(dataclasses.replace(request, hash_ids=tuple(ids[:count]), tokens_per_block=tokens))
    return out


def with_flood(requests: list[Request], factor: int) -> list[Request]:
    """`requests` as tenant `REPLAY_TENANT`, and between each of them and the next, `factor`
    prompts of tenant `FLOOD_TENANT` of the same size whose blocks no other request has:
    a neighbour flooding the engine with unique prompts at `factor` times the replay's rate.

    Raises:
        ValueError: `factor` is below 1.
    """
    if factor < 1:
        raise ValueError(f"the flood factor must be at least 1, got {factor}")
    fresh = itertools.count(max((max(r.hash_ids, default=0) for r in requests), default=0) + 1)
    out: list[Request] = []
    for request, after in zip(requests, [*requests[1:], None], strict=True):
        out.append(
            Request(request.timestamp_ms, request.input_length, request.output_length, request.hash_ids, REPLAY_TENANT)
        )
        gap = 0.0 if after is None else (after.timestamp_ms - request.timestamp_ms) / (factor + 1)
        for i in range(1, factor + 1):
            ids = tuple(itertools.islice(fresh, len(request.hash_ids)))
            out.append(
                Request(request.timestamp_ms + i * gap, request.input_length, request.output_length, ids, FLOOD_TENANT)
            )
    return out


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


def _shared_prefix(rng: np.random.Generator, ids: Iterator[int]) -> Iterator[list[int]]:
    prefixes = [[next(ids) for _ in range(32)] for _ in range(8)]
    while True:
        yield [*prefixes[int(rng.integers(len(prefixes)))], next(ids)]


def _hot_prefix(rng: np.random.Generator, ids: Iterator[int]) -> Iterator[list[int]]:
    system = [next(ids) for _ in range(HOT_SYSTEM_BLOCKS)]
    yield [*system, next(ids)]
    while True:
        firsts = [[*system, next(ids)] for _ in range(HOT_BURST)]
        yield from (list(turn) for turn in firsts)
        yield from ([*turn, next(ids)] for turn in firsts)
