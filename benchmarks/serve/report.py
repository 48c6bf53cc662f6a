"""The serving benchmark's results: per configuration, TTFT percentiles, throughput, where
the prompt tokens came from and the engine's counts; as JSON, a table and a TTFT CDF plot."""

from __future__ import annotations

from typing import Any

import numpy as np
from rich import box
from rich.console import Console
from rich.table import Table

from tiering.benchmarks.json_report import provenance
from tiering.benchmarks.serve.breakdown import FIELDS

SCHEMA_VERSION = 2  # 2: source (commit, dirty, cpus, python)
PERCENTILES = (50, 90, 99)


def summarize(run: dict[str, Any], reusable: list[int], block_tokens: int = 0) -> dict[str, Any]:
    """A configuration's numbers from its outcomes and counters (`run_configuration`'s or
    `run_fleet`'s result); `reusable`: each request's reusable prefix tokens
    (`reusable_prefix_tokens`). Times in seconds; TTFTs of failed requests are left out and
    the failures counted. ``breakdown_p50``: the median of each part of the TTFT (`FIELDS`)
    over the requests that loaded blocks from the engine (``loaded_requests``);
    ``copy_gbps``: the worker's loads into vLLM's cache, GB/s; ``found_tokens``: prompt
    tokens of blocks a secondary tier found in its store rather than stored itself (another
    replica's, in a shared tier), given `block_tokens` (tokens per offloaded block);
    ``disk_floor_p50_s`` and ``promoted_blocks_p50``: the medians over the requests with a
    disk floor (``floor_requests``; `tiering.benchmarks.serve.floor`), else None; a fleet's
    run adds each replica's own summary under ``replicas``."""
    outcomes = run["outcomes"]
    done = [o for o in outcomes if o["error"] is None]
    repeat = [o for o in done if reusable[o["index"]] > 0]
    wall_s = run["wall_s"]
    counters = run["vllm"]
    loaded = [o for o in done if o.get("engine")]
    load_seconds = counters.get("load_seconds")
    found = sum(counters.get("engine", {}).get("found_blocks_loaded", {}).values())
    floored = [o["engine"] for o in loaded if o["engine"].get("disk_floor_s") is not None]
    summary = {
        "requests": len(outcomes),
        "failed": len(outcomes) - len(done),
        "ttft_s": _percentiles([o["ttft_s"] for o in done]),
        "ttft_reusable_s": _percentiles([o["ttft_s"] for o in repeat]),
        "reusable_requests": len(repeat),
        "requests_per_s": len(done) / wall_s if wall_s else 0.0,
        "output_tokens_per_s": sum(o["output_tokens"] for o in done) / wall_s if wall_s else 0.0,
        "prompt_tokens": counters["prompt_tokens"],
        "computed_tokens": counters["computed_tokens"],
        "cached_tokens_by_source": counters["cached_tokens_by_source"],
        "wall_s": wall_s,
        "loaded_requests": len(loaded),
        "ttft_loaded_s": _percentiles([o["ttft_s"] for o in loaded]),
        "breakdown_p50": {f: float(np.median([o["engine"][f] for o in loaded])) for f in FIELDS} if loaded else None,
        "copy_gbps": counters["load_bytes"] / load_seconds / 1e9 if load_seconds else None,
        "found_tokens": found * block_tokens,
        "floor_requests": len(floored),
        "disk_floor_p50_s": _median([e["disk_floor_s"] for e in floored]),
        "promoted_blocks_p50": _median([e["promoted_blocks"] for e in floored]),
    }
    if run.get("apart") is not None:
        summary["apart"] = summarize_apart(
            [o for o in outcomes if o["index"] in set(run["apart"])], reusable, block_tokens
        )
    if "replicas" in run:
        summary["replicas"] = [
            summarize(
                {"outcomes": [o for o in outcomes if o["replica"] == i], "wall_s": wall_s, "vllm": r["vllm"]},
                reusable,
                block_tokens,
            )
            | {"cpus": r["cpus"]}
            for i, r in enumerate(run["replicas"])
        ]
    return summary


def summarize_apart(outcomes: list[dict[str, Any]], reusable: list[int], block_tokens: int) -> dict[str, Any]:
    """The requests a fleet's scenario reports apart (`tiering.benchmarks.serve.scenarios`):
    TTFT percentiles, prompt tokens and those computed (vLLM's cached tokens less), their
    reusable prefix tokens (`reusable_prefix_tokens`) and the part of those computed, and the
    tokens of blocks promoted from a secondary tier (the engine's request log)."""
    done = [o for o in outcomes if o["error"] is None]
    return {
        "requests": len(outcomes),
        "failed": len(outcomes) - len(done),
        "ttft_s": _percentiles([o["ttft_s"] for o in done]),
        "prompt_tokens": sum(o["prompt_tokens"] for o in done),
        "computed_tokens": sum(o["prompt_tokens"] - o["cached_tokens"] for o in done),
        "prefix_tokens": sum(reusable[o["index"]] for o in done),
        "prefix_computed_tokens": sum(max(0, reusable[o["index"]] - o["cached_tokens"]) for o in done),
        "promoted_tokens": sum(o.get("promoted_blocks", 0) for o in done) * block_tokens,
    }


def observed_prefill_rate(run: dict[str, Any]) -> float | None:
    """The fastest prefill `run` saw: the most prompt tokens per second of TTFT over its
    requests that found nothing cached (one that found the server idle; every other one
    also waited behind others); None if there is none."""
    rates = [o["prompt_tokens"] / o["ttft_s"] for o in run["outcomes"] if o["ttft_s"] and not o["cached_tokens"]]
    return max(rates, default=None)


def _median(values: list[float]) -> float | None:
    return float(np.median(values)) if values else None


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {f"p{p}": None for p in PERCENTILES}
    return {f"p{p}": float(np.percentile(values, p)) for p in PERCENTILES}


def build_report(runs: list[dict[str, Any]], reusable: list[int], inputs: dict[str, Any]) -> dict[str, Any]:
    """The JSON document: inputs, then per configuration its summary, counters and outcomes."""
    block_tokens = inputs.get("block_size", 0)
    return {
        "schema_version": SCHEMA_VERSION,
        "source": provenance(),
        "inputs": inputs,
        "reusable_prefix_tokens": reusable,
        "configurations": {run["name"]: {**run, "summary": summarize(run, reusable, block_tokens)} for run in runs},
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:,.0f}"


def print_summary(report: dict[str, Any], console: Console) -> None:
    """One row per configuration (and per replica of a fleet): TTFT (all requests, and those
    with a reusable prefix) p50/p90/p99 in ms, throughput, where the prompt tokens came from,
    and how many of a secondary tier's were blocks it found in its store (`found_tokens`):
    another replica's, or stored before a restart."""
    table = Table(box=box.MARKDOWN, title="TTFT ms p50 / p90 / p99")
    restarts = any("restart" in run for run in report["configurations"].values())
    found = "stored before the restart" if restarts else "another replica's"
    headers = ("", "TTFT all", "TTFT reusable", "req/s", "out tok/s", "computed", "served from", found)
    for header in headers:
        table.add_column(header, justify="left" if header in ("", "served from") else "right")
    for name, run in report["configurations"].items():
        summary = run["summary"]
        table.add_row(*_summary_row(name, summary))
        for i, replica in enumerate(summary.get("replicas", ())):
            table.add_row(*_summary_row(f"  replica {i} (cores {','.join(map(str, replica['cpus']))})", replica))
    for name, run in report["configurations"].items():
        console.print(f"{name}: {run['description']}")
    console.print(table)
    aparts = {
        name: run["summary"]["apart"] for name, run in report["configurations"].items() if "apart" in run["summary"]
    }
    if aparts:
        console.print(_apart_table(aparts))
    summaries = {name: run["summary"] for name, run in report["configurations"].items()}
    loads = {name: summary for name, summary in summaries.items() if summary["loaded_requests"]}
    if loads:
        console.print(_breakdown_table(loads))
    for name, summary in summaries.items():
        if summary["disk_floor_p50_s"] is not None and "b" in summaries:
            console.print(_over_the_floor(name, summary, summaries["b"]))


def _summary_row(name: str, summary: dict[str, Any]) -> tuple[str, ...]:
    served = [f"{source} {tokens:,.0f}" for source, tokens in summary["cached_tokens_by_source"].items() if tokens]
    return (
        name + (f" ({summary['failed']} failed)" if summary["failed"] else ""),
        " / ".join(_ms(v) for v in summary["ttft_s"].values()),
        " / ".join(_ms(v) for v in summary["ttft_reusable_s"].values()),
        f"{summary['requests_per_s']:.2f}",
        f"{summary['output_tokens_per_s']:.1f}",
        f"{summary['computed_tokens']:,.0f} of {summary['prompt_tokens']:,.0f}",
        ", ".join(served) or "-",
        f"{summary['found_tokens']:,.0f}" if summary["found_tokens"] else "-",
    )


def _apart_table(aparts: dict[str, dict[str, Any]]) -> Table:
    """The requests of each run's scenario, apart (`summarize_apart`)."""
    table = Table(box=box.MARKDOWN, title="The scenario's requests (scenarios.py): TTFT ms p50 / p90 / p99")
    headers = ("", "requests", "TTFT", "computed", "prefix computed", "from a secondary tier")
    for header in headers:
        table.add_column(header, justify="left" if not header else "right")
    for name, apart in aparts.items():
        table.add_row(
            name + (f" ({apart['failed']} failed)" if apart["failed"] else ""),
            str(apart["requests"]),
            " / ".join(_ms(v) for v in apart["ttft_s"].values()),
            f"{apart['computed_tokens']:,} of {apart['prompt_tokens']:,}",
            f"{apart['prefix_computed_tokens']:,} of {apart['prefix_tokens']:,}",
            f"{apart['promoted_tokens']:,}",
        )
    return table


def _breakdown_table(summaries: dict[str, dict[str, Any]]) -> Table:
    """Per configuration, the median parts of the TTFT of requests that loaded from the
    engine (`tiering.benchmarks.serve.breakdown`)."""
    table = Table(box=box.MARKDOWN, title="Requests that loaded from the engine: TTFT and its parts, p50 ms")
    headers = (
        "",
        "requests",
        "TTFT",
        "to lookup",
        "to loadable",
        "steps",
        "load",
        "steps",
        "of it waiting for promotions (blocks)",
        "after load",
        "copy GB/s",
        "disk floor (blocks)",
    )
    for header in headers:
        table.add_column(header, justify="left" if not header else "right")
    for name, summary in summaries.items():
        parts = summary["breakdown_p50"]
        gbps = summary["copy_gbps"]
        table.add_row(
            name,
            str(summary["loaded_requests"]),
            _ms(summary["ttft_loaded_s"]["p50"]),
            _ms(parts["to_lookup_s"]),
            _ms(parts["to_loadable_s"]),
            f"{parts['steps_to_load']:g}",
            _ms(parts["load_s"]),
            f"{parts['steps_loading']:g}",
            f"{_ms(parts['rows_wait_s'])} ({parts['blocks_pending']:g})",
            _ms(parts["after_load_s"]),
            "-" if gbps is None else f"{gbps:.2f}",
            "-"
            if summary["disk_floor_p50_s"] is None
            else f"{_ms(summary['disk_floor_p50_s'])} ({summary['promoted_blocks_p50']:g})",
        )
    return table


def _over_the_floor(name: str, summary: dict[str, Any], baseline: dict[str, Any]) -> str:
    """How far `name`'s TTFT p50 of requests with a reusable prefix sits above b's plus the
    disk's floor (`tiering.benchmarks.serve.floor`)."""
    ttft, base, floor = (
        summary["ttft_reusable_s"]["p50"],
        baseline["ttft_reusable_s"]["p50"],
        summary["disk_floor_p50_s"],
    )
    if ttft is None or base is None:
        return f"{name}: no request with a reusable prefix to set against b's"
    bound = base + floor
    return (
        f"{name}: TTFT p50 of requests with a reusable prefix {ttft * 1000:.1f} ms; b's {base * 1000:.1f} ms plus the "
        "disk's floor "
        f"(a raw O_DIRECT read of {summary['promoted_blocks_p50']:g} promoted blocks in the same directory, "
        f"{floor * 1000:.1f} ms) is {bound * 1000:.1f} ms: {name} is {abs(ttft - bound) * 1000:.1f} ms "
        f"{'over' if ttft > bound else 'under'} it"
    )


def plot(report: dict[str, Any], path: str) -> None:
    """The TTFT CDF of each configuration (all requests), as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 4.5))
    for name, run in report["configurations"].items():
        ttfts = sorted(o["ttft_s"] for o in run["outcomes"] if o["ttft_s"] is not None)
        if ttfts:
            axes.step(
                ttfts, np.arange(1, len(ttfts) + 1) / len(ttfts), where="post", label=f"{name}: {run['description']}"
            )
    axes.set_xscale("log")
    axes.set_xlabel("time to first token, s")
    axes.set_ylabel("share of requests")
    axes.set_ylim(0, 1)
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
