"""The shipped Grafana dashboard and Prometheus alert rules query only metrics a real engine
serves, and are well-formed."""

import json
import re
from pathlib import Path

import yaml

from tests.helpers import keys, region_name
from tiering import KVLayout, ReqContext, TieringOffloadingSpec, parse_config

MONITORING = Path(__file__).resolve().parents[1] / "monitoring"


def served_names() -> set[str]:
    """The sample names a real engine's exporter serves (with tenants, a failure, a hit, a
    miss and a promotion behind it), ``_bucket``/``_sum``/``_count`` and ``_total`` included."""
    from tests.test_metrics import scrape

    config = parse_config(
        "cpu_bytes_to_use: 64KiB\nmetrics: {port: 0, interval_s: 0.001}\ntenants: {}\n"
        "secondary_tiers: [{type: memory, capacity_bytes: 1MiB}]"
    )
    spec = TieringOffloadingSpec(config, KVLayout("tiny", 2, 64, 4), region_name())
    try:
        manager = spec.get_manager()
        context = ReqContext("r")
        out = manager.prepare_store(keys(0), context)
        manager.complete_store(out.keys_to_store, context)
        manager.lookup(keys(0)[0], context)
        manager.lookup(keys(1)[0], context)  # a miss
        manager.on_schedule_end()
        text = scrape(spec.exporter.port)
    finally:
        spec.shutdown()
    return set(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)[{ ]", text, re.MULTILINE))


def queried_metrics(expressions: list[str]) -> set[str]:
    return {name for expr in expressions for name in re.findall(r"\btiering_[a-z_]+\b", expr)}


def dashboard_expressions() -> list[str]:
    dashboard = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must differ"
    expressions = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    assert all(panel["datasource"]["uid"] == "${datasource}" for panel in dashboard["panels"])
    for variable in dashboard["templating"]["list"]:
        if "query" in variable and variable["type"] == "query":
            expressions.append(variable["query"])
    return expressions


def alert_rules() -> list[dict]:
    groups = yaml.safe_load((MONITORING / "prometheus-alerts.yml").read_text())["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert rule["labels"]["severity"] in ("warning", "critical") and rule["annotations"]["summary"]
        assert re.fullmatch(r"KVTiering[A-Za-z]+", rule["alert"])
    assert len({rule["alert"] for rule in rules}) == len(rules)
    return rules


def test_every_dashboard_and_alert_query_names_a_metric_the_engine_serves():
    served = served_names()
    rules = alert_rules()
    queried = queried_metrics(dashboard_expressions()) | queried_metrics([rule["expr"] for rule in rules])
    assert queried, "no queries found"
    assert queried - served == set()


def test_the_alerts_cover_an_unhealthy_tier_refusals_and_promotion_latency():
    expressions = " ".join(rule["expr"] for rule in alert_rules())
    for metric in (
        "tiering_tier_healthy",
        "tiering_tier_loop_alive",
        "tiering_tier_stores_refused_total",
        "tiering_tier_promotions_refused_total",
        "tiering_manager_promotion_seconds_bucket",
    ):
        assert metric in expressions, metric


def test_every_failure_reason_a_worker_records_is_counted_from_the_start():
    """A reason missing from FAILURE_REASONS would show up only once it happened: an alert
    rule or rate() on it would see no series before."""
    import ast

    from tiering.tiers.blockstore import outbox

    worker = Path(outbox.__file__).with_name("worker.py")
    recorded = {
        node.value
        for call in ast.walk(ast.parse(worker.read_text()))
        if isinstance(call, ast.Call) and getattr(call.func, "attr", None) == "failed"
        for node in ast.walk(call.args[0])
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }
    assert recorded and recorded <= set(outbox.FAILURE_REASONS)
