"""The load generator's results: a JSON document, a summary table, a plot."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

import numpy as np
from rich import box
from rich.console import Console
from rich.table import Table

from tiering.benchmarks.args import format_size
from tiering.benchmarks.json_report import provenance
from tiering.benchmarks.loadgen.run import RunStats
from tiering.tiers.context import PRIMARY_NAME

if TYPE_CHECKING:
    from tiering.benchmarks.loadgen.engine import SimulatedEngine

SCHEMA_VERSION = 8
# 2: prefix_hit_rate, each tier's cascades_dropped and cascades_filtered; 3: interrupted;
# 4: tiers' store_gbps/load_gbps over their busy time (store_busy_s, load_busy_s), `engine`;
# 5: hit_rate_by_tenant (requests that name a tenant, as with --flood); 6: cpu_tier (its
# retention counts and stats); 8: source (commit, dirty, cpus, python)
RETENTION_COUNTS = {  # (the CPU tier's counter or gauge, what the summary calls it)
    "retentions": "deadlines given",
    "retentions_released": "blocks released",
    "retentions_expired": "deadlines expired",
    "retentions_dropped": "deadlines given up",
    "retained_blocks": "blocks retained at the end",
}


def build_report(stats: RunStats, engine: SimulatedEngine, bounds: dict[str, float], inputs: dict[str, Any]) -> dict:
    """Everything measured, as a JSON-ready dict (durations in seconds unless named _us/_ms)."""
    sources = ["gpu", "cpu", *engine.manager.tier_names]
    hit_rate = _hit_rates(stats.tokens, sources)
    engine_stats = engine.manager.get_stats()
    tiers = {}
    for name, tier_stats in engine_stats["tiers"].items():  # with each tier's admission
        counters = tier_stats["counters"]
        stored, loaded = counters.get("bytes_stored", 0), counters.get("bytes_loaded", 0)
        store_busy_s, load_busy_s = counters.get("store_busy_seconds", 0.0), counters.get("load_busy_seconds", 0.0)
        tiers[name] = {
            "store_bytes": stored,
            "load_bytes": loaded,
            "store_busy_s": store_busy_s,
            "load_busy_s": load_busy_s,
            "store_gbps": stored / store_busy_s / 1e9 if store_busy_s else 0.0,
            "load_gbps": loaded / load_busy_s / 1e9 if load_busy_s else 0.0,
            "evictions": counters.get("evictions", 0),
            "failures": counters.get("failures", {}),
            "cascades_dropped": counters.get("cascades_dropped", 0),
            "cascades_filtered": counters.get("cascades_filtered", 0),
            "stats": tier_stats,
        }
    transfers = {}
    for direction, name in ((("GPU", "CPU"), "gpu_to_cpu"), (("CPU", "GPU"), "cpu_to_gpu")):
        done = [t for t in engine.transfers if t.transfer_type == direction and t.success]
        moved, busy = sum(t.transfer_size for t in done), sum(t.transfer_time for t in done)
        transfers[name] = {"bytes": moved, "gbps_while_copying": moved / busy / 1e9 if busy else 0.0}
    trace_span = inputs["trace_span_s"]
    return {
        "schema_version": SCHEMA_VERSION,
        "source": provenance(),
        "inputs": inputs,
        "requests": stats.requests,
        "interrupted": stats.interrupted,
        "wall_s": stats.wall_s,
        "requests_per_s": stats.requests / stats.wall_s,
        "realtime_factor": trace_span / stats.wall_s if stats.wall_s else None,
        "max_lag_s": max(stats.lag_s, default=0.0),
        "hit_rate": hit_rate,
        "hit_rate_by_tenant": {tenant: _hit_rates(tokens, sources) for tenant, tokens in stats.tenant_tokens.items()},
        "unbounded_hit_rate": bounds["unbounded"],
        "prefix_hit_rate": bounds["prefix"],
        "belady_hit_rate": bounds["belady"],
        "belady_capacity_blocks": engine.spec.num_blocks,
        "belady_all_tiers_hit_rate": bounds["belady_all_tiers"],
        "belady_all_tiers_capacity_blocks": bounds["all_tiers_blocks"],
        "verify_failures": stats.verify_failures,
        "store_refused_blocks": stats.store_refused_blocks,
        "failed_jobs": stats.failed_loads + sum(t["stats"]["counters"].get("jobs_failed", 0) for t in tiers.values()),
        "failed_calls": _failed_calls(tiers),
        "cpu_tier": {"retention": _retention(engine_stats["primary"]), "stats": engine_stats["primary"]},
        "tiers": tiers,
        "engine": _engine_counts(engine_stats),
        "transfers": transfers,
        "latency_us": {name: _percentiles(samples, 1e3) for name, samples in sorted(stats.calls_ns.items())},
        "promotion_latency_ms": _percentiles(stats.promotion_s, 1e-3),
    }


HINT_WORDS = {
    "none": "none",
    "continuation": "continuation: retain 5m while a conversation goes on, release at its last turn",
    "release": "every request releases its blocks",
}


def _retention(primary: dict[str, Any]) -> dict[str, int]:
    """The CPU tier's retention counts (`RETENTION_COUNTS`), from its stats."""
    values = {**primary["counters"], **primary["gauges"]}
    return {name: int(values.get(name, 0)) for name in RETENTION_COUNTS}


def _hit_rates(tokens: Counter, sources: list[str]) -> dict[str, float]:
    """Each source's share of the tokens, and ``total``: the share not missed."""
    served = sum(tokens.values())
    total = max(1, served)
    rates = {source: tokens[source] / total for source in sources}
    rates["total"] = (served - tokens["miss"]) / total  # (0 for a run stopped before its first request)
    return rates


def _engine_counts(engine_stats: dict[str, Any]) -> dict[str, Any]:
    """The engine's own per-request counts (`tiering.engine.lookups`): what Prometheus shows."""
    manager = engine_stats["manager"]["counters"]
    parts = {PRIMARY_NAME: engine_stats["primary"], **engine_stats["tiers"]}
    requested = manager.get("requested_tokens", 0)
    hit_tokens = {name: part["counters"].get("hit_tokens", 0) for name, part in parts.items()}
    return {
        "requested_tokens": requested,
        "hit_tokens": hit_tokens,
        "hit_rate": sum(hit_tokens.values()) / requested if requested else 0.0,
        "lookups_repeated": manager.get("lookups_repeated", 0),
    }


def _percentiles(samples: list[float], per_unit: float) -> dict[str, float]:
    if not samples:
        return {"count": 0}
    values = np.asarray(samples, dtype=np.float64) / per_unit
    return {"count": len(values), "p50": float(np.percentile(values, 50)), "p99": float(np.percentile(values, 99))}


def print_summary(report: dict, console: Console) -> None:
    """The report as tables: what ran, hit rates with their bounds, tiers, scheduler-call
    latencies."""
    console.print(_run_table(report["inputs"], report["belady_capacity_blocks"]))
    hits = Table(title=f"{report['requests']} requests in {report['wall_s']:.1f} s")
    hits.add_column("hit rate (tokens)")
    hits.add_column("value", justify="right")
    for source, rate in report["hit_rate"].items():
        hits.add_row(source, f"{rate:.1%}")
    # A warm start begins with blocks an earlier run stored: the bounds, of this run's
    # requests alone, no longer bound it.
    bound = "bound (not with --warm-start)" if report["inputs"]["warm_start"] else "bound"
    hits.add_row(f"{bound}: every repeated block", f"{report['unbounded_hit_rate']:.1%}")
    hits.add_row(f"{bound}: repeated prefixes (no capacity limit)", f"{report['prefix_hit_rate']:.1%}")
    capacity = report["belady_capacity_blocks"]
    hits.add_row(f"{bound}: Belady at the CPU tier's {capacity:,} blocks", f"{report['belady_hit_rate']:.1%}")
    if report["belady_all_tiers_hit_rate"] is not None:
        capacity = report["belady_all_tiers_capacity_blocks"]
        hits.add_row(f"{bound}: Belady at all tiers' {capacity:,} blocks", f"{report['belady_all_tiers_hit_rate']:.1%}")
    hits.add_row("verify failures", str(report["verify_failures"]))
    hits.add_row("failed jobs", str(report["failed_jobs"]))
    if report["failed_calls"]:  # a delete or probe that failed fails no job: shown apart, by kind
        failed = ", ".join(f"{count:,} {reason}" for reason, count in report["failed_calls"].items())
        hits.add_row("failed tier calls (not jobs)", failed)
    hits.add_row("blocks not stored (no room in the CPU tier)", str(report["store_refused_blocks"]))
    if report["realtime_factor"] is not None:
        hits.add_row("replay speed vs the trace's clock", f"{report['realtime_factor']:.1f}x")
    if report["inputs"]["hints"] != "none":
        for name, label in RETENTION_COUNTS.items():
            hits.add_row(f"cpu tier: {label}", f"{report['cpu_tier']['retention'][name]:,}")
    console.print(hits)
    if report["hit_rate_by_tenant"]:
        tenants = Table(title="Hit rate by tenant (tokens)", box=box.SIMPLE)
        for column in ("tenant", *next(iter(report["hit_rate_by_tenant"].values()))):
            tenants.add_column(column, justify="left" if column == "tenant" else "right")
        for tenant, rates in report["hit_rate_by_tenant"].items():
            tenants.add_row(tenant, *(f"{rate:.1%}" for rate in rates.values()))
        console.print(tenants)
    tiers = Table(title="Secondary tiers (GB/s: while busy storing or loading)", box=box.SIMPLE, pad_edge=False)
    tiers.add_column("tier", overflow="fold")  # a long name folds; the numbers never shrink
    tiers.caption = "failed: jobs / calls (a failed delete or probe fails no job)"
    for column in ("stored", "GB/s", "loaded", "GB/s", "evicted", "failed", "dropped", "health"):
        tiers.add_column(column, justify="right", no_wrap=True)
    for name, tier in report["tiers"].items():
        counters, gauges = tier["stats"]["counters"], tier["stats"]["gauges"]
        tiers.add_row(
            name,
            format_size(tier["store_bytes"]),
            f"{tier['store_gbps']:.2f}",
            format_size(tier["load_bytes"]),
            f"{tier['load_gbps']:.2f}",
            str(tier["evictions"]),
            f"{counters.get('jobs_failed', 0):,} / {sum(tier['failures'].values()):,}",
            str(tier["cascades_dropped"]),
            str(gauges.get("state", "")),
        )
    console.print(tiers)
    transfers = Table(title="GPU<->CPU copies", box=box.SIMPLE)
    for column in ("direction", "moved", "GB/s while copying"):
        transfers.add_column(column, justify="left" if column == "direction" else "right", no_wrap=True)
    for name, transfer in report["transfers"].items():
        transfers.add_row(
            name.replace("_to_", " -> "), format_size(transfer["bytes"]), f"{transfer['gbps_while_copying']:.2f}"
        )
    console.print(transfers)
    calls = Table(title="Scheduler-thread calls and promotions")
    for column in ("call", "count", "p50", "p99"):
        calls.add_column(column, justify="left" if column == "call" else "right")
    for name, latency in report["latency_us"].items():
        calls.add_row(name, str(latency["count"]), f"{latency['p50']:.1f} us", f"{latency['p99']:.1f} us")
    promotion = report["promotion_latency_ms"]
    if promotion["count"]:
        calls.add_row("promotion", str(promotion["count"]), f"{promotion['p50']:.2f} ms", f"{promotion['p99']:.2f} ms")
    console.print(calls)


def _failed_calls(tiers: dict[str, dict[str, Any]]) -> dict[str, int]:
    """The tiers' failed calls by kind (store, load, delete, probe ...), summed; kinds with
    none left out."""
    total: dict[str, int] = {}
    for tier in tiers.values():
        for reason, count in tier["failures"].items():
            if count:
                total[reason] = total.get(reason, 0) + count
    return total


def _run_table(inputs: dict[str, Any], cpu_blocks: int) -> Table:
    """The configuration the run used, one fact per row."""
    table = Table(title="Run", box=box.SIMPLE, pad_edge=False, show_header=False)
    table.add_column("what", no_wrap=True)
    table.add_column("value", overflow="fold")
    config, block_bytes = inputs["config"], inputs["bytes_per_block"]
    source = inputs["trace"] or f"synthetic {inputs['workload']} workload"
    table.add_row("requests", f"{source}, seed {inputs['seed']}")
    model = inputs["model"] or "a made-up model (--model: a preset)"
    table.add_row("block", f"{format_size(block_bytes)}: {config['block_size']} tokens of {model}")
    cpu_bytes = cpu_blocks * block_bytes
    table.add_row("cpu tier", f"{cpu_blocks:,} blocks ({format_size(cpu_bytes)}), {config['eviction_policy']}")
    for tier in config["secondary_tiers"]:
        capacity = tier.get("capacity_bytes")
        size = f"up to {format_size(capacity)}" if capacity else "no capacity limit"
        named = tier["type"] if tier["name"] == tier["type"] else f"{tier['name']} ({tier['type']})"
        table.add_row("secondary tier", f"{named}, {size}")
    gpu = f"{inputs['gpu_blocks']:,} blocks" if inputs["gpu_prefix_cache"] else "off"
    table.add_row("gpu prefix cache", gpu)
    scale = inputs["time_scale"]
    table.add_row("pace", f"{scale:g} s per trace second" if scale else "flat out")
    table.add_row("retention hints", HINT_WORDS.get(inputs["hints"], f"every request sends {inputs['hints']}"))
    table.add_row("namespace", f"{inputs['namespace']}" + (" (warm start)" if inputs["warm_start"] else ""))
    return table


def plot(stats: RunStats, sources: list[str], path: str) -> None:
    """Cumulative hit rate per source over the run, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 4.5))
    requests = [index for index, _ in stats.timeline]
    for source in [*sources, "miss"]:
        rates = [tokens.get(source, 0) / max(1, sum(tokens.values())) for _, tokens in stats.timeline]
        axes.plot(requests, rates, label=source)
    axes.set_xlabel("requests replayed")
    axes.set_ylabel("share of prompt tokens (cumulative)")
    axes.set_ylim(0, 1)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
