"""The Grafana dashboard and the Prometheus scrape config in packaging/ match the code: every query
names metrics the daemon or the registry exports, with labels and label values they carry, and the
committed dashboard is what scripts/grafana.py generates."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

from rolloutd import metrics as node_metrics
from rolloutd.registry.rollouts import BEHIND_BUCKETS
from rolloutd.registry.service import Metrics as RegistryMetrics
from rolloutd.trainer import EmbeddedRegistry
from rolloutd.wire.states import ServerState

ROOT = Path(__file__).parents[3]
DASHBOARD = ROOT / "packaging" / "grafana" / "rolloutd.json"
SCRAPE = ROOT / "packaging" / "prometheus" / "rolloutd.yml"
TARGET_LABELS = {"instance", "job"}  # Prometheus adds them to every series it scrapes
FUNCTIONS = {"sum", "count", "max", "min", "avg", "rate", "increase", "histogram_quantile", "vector", "by"}
KNOWN_VALUES = {  # labels whose values the code fixes
    "state": {s.name for s in ServerState}, "rolloutd_server_state": {s.name for s in ServerState},
    "behind": set(BEHIND_BUCKETS), "phase": set(node_metrics.UPDATE_PHASES),
    "kind": set(node_metrics.FAILURE_KINDS) | set(node_metrics.PULL_KINDS),  # update failures; pull bytes
    "result": set(node_metrics.PULL_RESULTS), "task": set(node_metrics.TASKS),
}


def exported() -> dict[str, set[str]]:
    """Every series name the code exports -> the labels it may carry."""
    names: dict[str, set[str]] = {}
    for owner in (node_metrics.Metrics(), RegistryMetrics()):
        for metric in vars(owner).values():
            if not isinstance(metric, MetricWrapperBase):
                continue
            labels = set(metric._labelnames) | TARGET_LABELS
            kind, name = metric._type, metric._name
            if kind == "counter":
                names[name + "_total"] = labels
            elif kind == "histogram":
                names.update({name + "_bucket": labels | {"le"}, name + "_sum": labels, name + "_count": labels})
            elif kind == "stateset":
                names[name] = labels | {name}
            else:
                names[name] = labels
    return names


def queries() -> list[str]:
    doc = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in doc["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in doc["templating"]["list"] if v["type"] == "query"]
    return exprs


def test_the_committed_dashboard_is_the_generated_one():
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "grafana.py"), "--check"], capture_output=True,
                         text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr


def test_the_dashboard_is_a_grafana_dashboard():
    doc = json.loads(DASHBOARD.read_text())
    assert doc["uid"] and doc["schemaVersion"] >= 36 and doc["panels"]
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    for p in doc["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        for t in p.get("targets", []):
            assert t["datasource"]["uid"] == "${datasource}" and t["refId"]
    names = [v["name"] for v in doc["templating"]["list"]]
    used = {m for q in queries() for m in re.findall(r"\$(\w+)", q)} - {"__rate_interval"}
    assert used <= set(names), used - set(names)


@pytest.mark.parametrize("expr", queries())
def test_every_query_names_exported_metrics_and_labels(expr):
    series = exported()
    by_clauses = re.findall(r"\bby \(([^)]*)\)", expr)
    outside_by = re.sub(r"\bby \([^)]*\)", "", expr)
    selectors = re.findall(r"\b(rolloutd_\w+)\{([^}]*)\}", outside_by)
    named = re.findall(r"\brolloutd_\w+", re.sub(r'"[^"]*"', "", outside_by))
    var_query = re.fullmatch(r"label_values\((rolloutd_\w+), (\w+)\)", expr)
    if var_query:
        assert var_query[1] in series and var_query[2] in series[var_query[1]]
        return
    assert selectors, f"names no rolloutd metric: {expr}"
    assert len(named) == len(selectors), f"a metric without a label selector: {expr}"
    labels_here = set()
    for name, matchers in selectors:
        assert name in series, f"{name} is not exported by the code (query: {expr})"
        labels_here |= series[name]
        for label, _op, value in re.findall(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"', matchers):
            assert label in series[name], f"{name} has no label {label}"
            if label in KNOWN_VALUES and not value.startswith("$"):
                assert set(value.split("|")) <= KNOWN_VALUES[label], f"{label}={value!r} is never exported"
    for clause in by_clauses:
        for label in (x.strip() for x in clause.split(",")):
            assert label in labels_here, f"by ({label}): no metric of the query has it: {expr}"
    assert set(re.findall(r"\b([a-z_]+)\s*\(", outside_by)) <= FUNCTIONS
    assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}") and \
        expr.count("[") == expr.count("]")


def test_every_metric_the_dashboard_names_is_on_a_real_registry_scrape_or_in_the_daemon_text(tmp_path):
    named = {re.sub(r"_(bucket|sum|count)$", "", m) for q in queries() for m in re.findall(r"\brolloutd_\w+", q)}
    (tmp_path / "token").write_text("scrape-token")
    with EmbeddedRegistry(port=0, token_file=tmp_path / "token") as reg:
        scraped = httpx.get(reg.url + "/metrics", headers={"authorization": "Bearer scrape-token"}).text
    daemon_text = node_metrics.Metrics().render()[0].decode()
    helped = set(re.findall(r"^# HELP (\S+)", scraped + daemon_text, re.M))
    assert named <= helped, named - helped


def test_the_scrape_config_names_both_targets_and_the_registry_token():
    cfg = yaml.safe_load(SCRAPE.read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert set(jobs) == {"rolloutd-registry", "rolloutd-node"}
    assert all(j["metrics_path"] == "/metrics" and j["static_configs"][0]["targets"] for j in jobs.values())
    auth = jobs["rolloutd-registry"]["authorization"]
    assert auth["type"] == "Bearer" and auth["credentials_file"]
    assert "authorization" not in jobs["rolloutd-node"]  # the admin API's GET routes take no token
    assert jobs["rolloutd-node"]["static_configs"][0]["targets"][0].endswith(":9100")
