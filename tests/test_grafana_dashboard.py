"""deploy/grafana/xpu-serve-dashboard.json: a Grafana dashboard model whose every PromQL
expression promtool parses (`promtool check rules` on a rule file with one recording rule per
expression, Grafana's variables replaced by values) and whose every metric name a LIVE
supervisor (the simulator) serves."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from .e2e.harness import start_with_metrics, up_factory  # noqa: F401, F811  (a pytest fixture, found by name)
from .test_prometheus_rules import SCRAPE_MADE, _promtool, metric_names

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "xpu-serve-dashboard.json"
# Grafana's variables (dashboard templating and built-ins) -> what Prometheus gets in their place
GRAFANA_VARS = {"$__rate_interval": "1m", "$__range": "6h", "$__interval": "15s", "$instance": ".*"}
# what the dashboard must show (one family per panel at least)
FAMILIES = {
    "xpu_serve_state", "xpu_serve_startup_phase", "xpu_serve_incidents_total", "xpu_serve_restarts_total",
    "xpu_serve_hang_detections_total", "xpu_serve_kernel_events_total", "xpu_serve_webhook_failures_total",
}


def panels(node: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for p in node.get("panels", []):
        out.append(p)
        out += panels(p)  # a collapsed row keeps its panels inside
    return out


def exprs() -> dict[str, str]:
    """refId-qualified panel title -> PromQL expression, for every target of every panel."""
    model = json.loads(DASHBOARD.read_text())
    return {f"{p['title']} [{t['refId']}]": t["expr"] for p in panels(model) for t in p.get("targets", [])}


def prometheus_expr(expr: str) -> str:
    for var, value in GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    assert "$" not in expr, f"a Grafana variable without a value here: {expr}"
    return expr


def test_dashboard_model_shape() -> None:
    model = json.loads(DASHBOARD.read_text())
    assert model["uid"] == "xpu-serve" and model["schemaVersion"] >= 36
    ps = panels(model)
    ids = [p["id"] for p in ps]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in ps:
        assert {"h", "w", "x", "y"} <= p["gridPos"].keys() and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
            assert p["targets"], p["title"]
    variables = {v["name"]: v for v in model["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert "xpu_serve_build_info" in variables["instance"]["definition"]
    used = set().union(*(metric_names(e) for e in exprs().values()))
    assert FAMILIES <= used, f"no panel for {sorted(FAMILIES - used)}"
    for e in exprs().values():
        assert 'job="xpu-serve"' in e, e  # the PodMonitor's job label (deploy/kubernetes)


def test_promtool_parses_every_expression(tmp_path: Path) -> None:
    exe = _promtool()
    rules = [{"record": f"dashboard:expr_{i}", "expr": prometheus_expr(e)} for i, e in enumerate(exprs().values())]
    f = tmp_path / "dashboard-rules.yaml"
    f.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}, sort_keys=False))
    r = subprocess.run([exe, "check", "rules", str(f)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(rules)} rules found" in r.stdout
    f.write_text(yaml.safe_dump({"groups": [{"name": "d", "rules": [{"record": "x:y", "expr": "sum by (cause"}]}]}))
    assert subprocess.run([exe, "check", "rules", str(f)], capture_output=True, timeout=60).returncode != 0


@pytest.mark.e2e
def test_every_dashboard_metric_is_served_by_a_live_supervisor(up_factory: Any) -> None:  # noqa: F811
    u = up_factory(tp=2)
    mport = start_with_metrics(u)
    text = httpx.get(f"http://127.0.0.1:{mport}/metrics", timeout=5).text
    served = set()
    for fam in text_string_to_metric_families(text):
        served |= {s.name for s in fam.samples}
        # a labelled family with no series yet (no kernel record so far) is declared by # TYPE
        served.add(f"{fam.name}_total" if fam.type == "counter" else fam.name)
    used = set().union(*(metric_names(e) for e in exprs().values())) - SCRAPE_MADE
    assert not used - served, f"the dashboard uses metrics the supervisor does not serve: {sorted(used - served)}"
    assert re.search(r'^xpu_serve_time_to_ready_seconds_bucket\{le="', text, re.M)
