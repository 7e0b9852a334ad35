"""The Prometheus alert rules (deploy/prometheus/) with the real promtool: `check rules`, their
unit tests (`test rules`), and every metric name a rule uses evaluated by promtool against a
LIVE supervisor's scrape (the simulator), written as a promtool series file."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from .e2e.harness import start_with_metrics, up_factory  # noqa: F401, F811  (a pytest fixture, found by name)

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "deploy" / "prometheus" / "xpu-serve-rules.yaml"
TESTS = ROOT / "deploy" / "prometheus" / "xpu-serve-rules.test.yaml"
# metrics Prometheus makes itself from a scrape, not the target
SCRAPE_MADE = {"up"}
_PROMQL_WORDS = {
    "sum", "by", "without", "increase", "rate", "absent", "or", "and", "unless", "on", "ignoring",
    "count", "max", "min", "avg", "vector", "humanize", "bool", "offset", "group_left", "group_right",
    "histogram_quantile", "time",
}


def _promtool() -> str:
    exe = shutil.which("promtool")
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("promtool missing (.ci/run installs the Debian package prometheus)")
        pytest.skip("promtool not installed (apt-get install --no-install-recommends prometheus)")
    return exe


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers outside {...} label matchers, [...]
    ranges and strings, minus PromQL's functions and keywords."""
    bare = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", bare)
    bare = re.sub(r"\boffset\s+[^\s()]+|\$\w+", " ", bare)  # `offset 15m`, Grafana's $variables
    bare = re.sub(r"\b(?:by|without|on|ignoring)\s*\([^)]*\)", " ", bare)  # grouping labels
    names = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", bare)) - _PROMQL_WORDS
    return {n for n in names if not n.isdigit()}


def rule_exprs() -> dict[str, str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {r["alert"]: r["expr"] for g in groups for r in g["rules"]}


def test_promtool_check_and_unit_tests() -> None:
    exe = _promtool()
    check = subprocess.run([exe, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "SUCCESS: 6 rules found" in check.stdout
    test = subprocess.run([exe, "test", "rules", str(TESTS)], capture_output=True, text=True, timeout=60,
                          cwd=TESTS.parent)
    assert test.returncode == 0, test.stdout + test.stderr
    assert set(rule_exprs()) == {
        "XpuServeSupervisorDown", "XpuServeGaveUp", "XpuServeCrashLooping", "XpuServeHangDetected",
        "XpuServeGpuKernelFaults", "XpuServeNotReady",
    }


def test_metric_names_extracted() -> None:
    assert metric_names('sum by (instance, kind) (increase(a_total{kind!~"x|y"}[15m])) > 0') == {"a_total"}
    assert metric_names('up{job="x"} == 0 or absent(up{job="x"})') == {"up"}


def _series_file(text: str) -> list[dict[str, str]]:
    out = []
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(
                f'{k}="{v.replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
                for k, v in sorted(s.labels.items())
            )
            v = repr(float(s.value))
            out.append({"series": f"{s.name}{{{labels}}}", "values": f"{v} {v} {v}"})
    return out


@pytest.mark.e2e
def test_every_rule_metric_exists_in_a_live_scrape(up_factory: Any, tmp_path: Path) -> None:  # noqa: F811
    exe = _promtool()
    u = up_factory(tp=2)
    mport = start_with_metrics(u)
    text = httpx.get(f"http://127.0.0.1:{mport}/metrics", timeout=5).text
    series = _series_file(text)
    counts: dict[str, int] = {}
    for s in series:
        name = s["series"].split("{", 1)[0]
        counts[name] = counts.get(name, 0) + 1
    used = set().union(*(metric_names(e) for e in rule_exprs().values())) - SCRAPE_MADE
    assert used, "no metric names found in the rules"
    # a labelled family with no series yet (no kernel record so far) is declared by # TYPE
    declared = {
        f"{f.name}_total" if f.type == "counter" else f.name for f in text_string_to_metric_families(text)
    }
    missing = used - set(counts) - declared
    assert not missing, f"rules use metrics the supervisor does not serve: {sorted(missing)}"
    used = used & set(counts)
    # promtool evaluates count(NAME) for every used name over the scraped samples
    spec = {
        "tests": [
            {
                "interval": "1m",
                "input_series": series,
                "promql_expr_test": [
                    {"expr": f"count({n})", "eval_time": "1m", "exp_samples": [{"labels": "{}", "value": counts[n]}]}
                    for n in sorted(used)
                ],
            }
        ]
    }
    f = tmp_path / "scrape.test.yaml"
    f.write_text(yaml.safe_dump(spec, sort_keys=False))
    r = subprocess.run([exe, "test", "rules", str(f)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
