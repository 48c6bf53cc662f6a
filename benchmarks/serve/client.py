"""An OpenAI-API client that replays requests at their arrival times and times each one.

Each request is a streamed ``/v1/completions`` call with the prompt as token ids, greedy, a
fixed number of output tokens (``ignore_eos``), the request id ``bench-<index>`` (the
``X-Request-Id`` header; vLLM's own ids for it contain that) and its retention hint, if it
has one, in the body's ``kv_transfer_params`` (``{"kv_tiering": hint}``, `tiering.eviction.retention`),
as a client of the engine sends it. Its time to first token is
measured from the moment it was due (its arrival), so time spent waiting for a connection
slot counts, as a user would see it.

With several servers (replicas of one model), a `Routing` chooses each request's replica when
it arrives (`tiering.benchmarks.serve.routing`), and hears when it starts and ends.

Thread: `replay` runs its own event loop in the calling thread.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from tiering.benchmarks.serve.routing import Routing
from tiering.eviction.retention import HINT_KEY


@dataclass
class Outcome:
    """One request: `arrival_s` (from the start of the run), `due_monotonic` (its arrival on
    ``time.monotonic``'s clock, as the engine's request log reads it), `ttft_s` and
    `latency_s` (from its arrival; None if it failed), tokens generated, prompt tokens vLLM
    reported cached (its prefix cache and the connector's together), the replica that served
    it, and the error if it failed."""

    index: int
    arrival_s: float
    prompt_tokens: int
    due_monotonic: float = 0.0
    replica: int = 0
    ttft_s: float | None = None
    latency_s: float | None = None
    output_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def replay(
    url: str | list[str],
    model: str,
    prompts: list[list[int]],
    arrivals_s: list[float],
    max_tokens: int,
    max_concurrency: int | None = None,
    timeout_s: float = 600.0,
    hints: list[dict[str, Any] | None] | None = None,
    routing: Routing | None = None,
    actions: Sequence[tuple[float, Callable[[], Awaitable[None]]]] = (),
) -> list[Outcome]:
    """Send ``prompts[i]`` at ``arrivals_s[i]`` seconds from now (at most `max_concurrency`
    in flight, None: no limit), with the retention hint ``hints[i]`` (None: none; `hints`
    None: no request has one), to the server at `url` or, given a list of replicas' URLs,
    to the one `routing` chooses (None: the first), and wait for all of them, and for each
    of `actions` (a coroutine function run at its time, seconds from now, on the same event
    loop: a replica killed, or joining); outcomes in request order."""
    urls = [url] if isinstance(url, str) else url
    hints = hints or [None] * len(prompts)
    return asyncio.run(
        _replay(urls, model, prompts, arrivals_s, max_tokens, max_concurrency, timeout_s, hints, routing, actions)
    )


async def _replay(
    urls: list[str],
    model: str,
    prompts: list[list[int]],
    arrivals_s: list[float],
    max_tokens: int,
    max_concurrency: int | None,
    timeout_s: float,
    hints: list[dict[str, Any] | None],
    routing: Routing | None,
    actions: Sequence[tuple[float, Callable[[], Awaitable[None]]]],
) -> list[Outcome]:
    slots = asyncio.Semaphore(max_concurrency or len(prompts) or 1)
    limits = httpx.Limits(max_connections=max_concurrency or len(prompts) or 1)
    clients = [httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) for url in urls]
    try:
        start = time.monotonic()

        async def one(index: int) -> Outcome:
            due = start + arrivals_s[index]
            outcome = Outcome(index, arrivals_s[index], len(prompts[index]), due)
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            if routing is not None:
                try:
                    outcome.replica = routing.choose(index, prompts[index])
                except RuntimeError as exc:  # no replica in service
                    outcome.error = str(exc)
                    return outcome
                routing.started(outcome.replica)
            try:
                async with slots:
                    client = clients[outcome.replica]
                    await _complete(client, model, prompts[index], max_tokens, hints[index], outcome, due)
            finally:
                if routing is not None:
                    routing.finished(outcome.replica)
            return outcome

        async def act(at_s: float, action: Callable[[], Awaitable[None]]) -> None:
            await asyncio.sleep(max(0.0, start + at_s - time.monotonic()))
            await action()

        outcomes = asyncio.gather(*(one(i) for i in range(len(prompts))))
        await asyncio.gather(outcomes, *(act(at_s, action) for at_s, action in actions))
        return list(outcomes.result())
    finally:
        for client in clients:
            await client.aclose()


async def _complete(
    client: httpx.AsyncClient,
    model: str,
    prompt: list[int],
    max_tokens: int,
    hint: dict[str, Any] | None,
    outcome: Outcome,
    due: float,
) -> None:
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if hint is not None:
        body["kv_transfer_params"] = {HINT_KEY: hint}
    try:
        headers = {"X-Request-Id": f"bench-{outcome.index}"}
        async with client.stream("POST", "/v1/completions", json=body, headers=headers) as response:
            if response.status_code != 200:
                outcome.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                if chunk.get("error") and outcome.error is None:  # the server failed mid-stream
                    outcome.error = f"in the stream: {json.dumps(chunk['error'])[:200]}"
                if chunk.get("choices") and outcome.ttft_s is None:
                    outcome.ttft_s = time.monotonic() - due
                usage = chunk.get("usage")
                if usage:
                    outcome.output_tokens = usage.get("completion_tokens", 0)
                    outcome.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        outcome.latency_s = time.monotonic() - due
        if outcome.ttft_s is None and outcome.error is None:
            outcome.error = "the stream ended without a token"
    except httpx.HTTPError as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
        outcome.ttft_s = None
