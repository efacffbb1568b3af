"""The Grafana dashboard ``packaging/grafana/rolloutd.json``, generated from the panel list below.

One dashboard over both kinds of target the scrape config example
(``packaging/prometheus/rolloutd.yml``) names: the registry (``rolloutd_registry_*``, on the
trainer's host) and every node's daemon (the admin API's ``/metrics``). A test checks the
committed file against this script and that every query names metrics, and labels, that the code
exports. After changing a panel::

    python scripts/grafana.py            # rewrites packaging/grafana/rolloutd.json
    python scripts/grafana.py --check    # exit 1 when it is stale
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = Path("packaging/grafana/rolloutd.json")
DS = {"type": "prometheus", "uid": "${datasource}"}
REG = 'instance=~"$registry"'
NODE = 'instance=~"$node"'
RATE = "$__rate_interval"


def ts(title: str, targets: list[tuple[str, str]], unit: str = "short", stack: bool = False,
       description: str = "", w: int = 8) -> dict:
    """A time series panel; ``targets`` are (PromQL, legend)."""
    custom = {"lineWidth": 1, "fillOpacity": 20 if stack else 0, "showPoints": "never",
              "stacking": {"mode": "normal" if stack else "none"}}
    return {"type": "timeseries", "title": title, "description": description, "datasource": DS, "_w": w,
            "fieldConfig": {"defaults": {"unit": unit, "custom": custom}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
            "targets": [{"refId": chr(65 + i), "datasource": DS, "expr": expr, "legendFormat": legend}
                        for i, (expr, legend) in enumerate(targets)]}


def stat(title: str, expr: str, unit: str = "short", description: str = "", red_above: float | None = None) -> dict:
    steps = [{"color": "green", "value": None}] + ([{"color": "red", "value": red_above}] if red_above is not None
                                                   else [])
    return {"type": "stat", "title": title, "description": description, "datasource": DS, "_w": 4,
            "fieldConfig": {"defaults": {"unit": unit, "thresholds": {"mode": "absolute", "steps": steps}},
                            "overrides": []},
            "options": {"reduceOptions": {"calcs": ["lastNotNull"]}, "colorMode": "value", "graphMode": "area"},
            "targets": [{"refId": "A", "datasource": DS, "expr": expr, "legendFormat": title}]}


def quantiles(metric: str, selector: str, by: str = "", qs: tuple[float, ...] = (0.5, 0.9, 0.99)) -> list:
    group = f"le{', ' + by if by else ''}"
    legend = "".join(f"{{{{{b.strip()}}}}} " for b in by.split(",") if b.strip())
    return [(f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{{{selector}}}[{RATE}])))",
             f"{legend}p{round(q * 100)}") for q in qs]


def row(title: str) -> dict:
    return {"type": "row", "title": title, "collapsed": False, "panels": [], "_w": 24}


PANELS = [
    row("Fleet (the registry)"),
    stat("Newest version", f"max(rolloutd_registry_latest_version{{{REG}}})"),
    stat("Replicas", f"sum(rolloutd_registry_replicas{{{REG}}})"),
    stat("Replicas failing", f'sum(rolloutd_registry_replica_states{{{REG}, state=~"BACKOFF|FATAL"}}) or vector(0)',
         red_above=1, description="replicas whose last heartbeat said BACKOFF or FATAL"),
    stat("Replicas not on the newest", f'sum(rolloutd_registry_replicas_behind{{{REG}, behind!="0"}})',
         description="one or more versions behind, or on the start model"),
    stat("Heartbeats / s", f"sum(rate(rolloutd_registry_heartbeats_total{{{REG}}}[{RATE}]))", unit="reqps"),
    stat("Egress", f"sum(rate(rolloutd_registry_served_bytes_total{{{REG}}}[{RATE}]))", unit="Bps"),
    ts("Replicas by state", [(f"sum by (state) (rolloutd_registry_replica_states{{{REG}}})", "{{state}}")],
       stack=True),
    ts("Replicas by versions behind the newest",
       [(f"sum by (behind) (rolloutd_registry_replicas_behind{{{REG}}})", "{{behind}} behind")], stack=True),
    ts("Publish → serving", quantiles("rolloutd_registry_publish_to_serving_seconds", REG), unit="s",
       description="from a version's publish to each replica's first SERVING report of it"),
    ts("Registry request latency (p99)",
       quantiles("rolloutd_registry_request_seconds", REG, by="route", qs=(0.99,)), unit="s"),
    ts("Registry answers by status",
       [(f"sum by (status) (rate(rolloutd_registry_requests_total{{{REG}}}[{RATE}]))", "{{status}}")],
       unit="reqps", stack=True),
    ts("Versions and leases",
       [(f"sum by (state) (rolloutd_registry_versions{{{REG}}})", "versions {{state}}"),
        (f"sum(rolloutd_registry_leases{{{REG}}})", "leases"),
        (f"sum(rate(rolloutd_registry_publishes_total{{{REG}}}[{RATE}])) * 3600", "publishes / h"),
        (f"sum(rate(rolloutd_registry_uploaded_bytes_total{{{REG}}}[{RATE}]))", "upload bytes / s")]),

    row("Nodes (the daemons)"),
    ts("Servers by state",
       [(f"count by (rolloutd_server_state) (rolloutd_server_state{{{NODE}}} == 1)", "{{rolloutd_server_state}}")],
       stack=True),
    ts("Version loaded, per server", [(f"rolloutd_server_version{{{NODE}}}", "{{instance}} {{server}}")],
       description="-1: the start model"),
    ts("Pause per update", quantiles("rolloutd_pause_seconds", NODE), unit="s",
       description="pause to resume, one observation per server and update"),
    ts("Update phases (p90)", quantiles("rolloutd_update_phase_seconds", NODE, by="phase", qs=(0.9,)), unit="s"),
    ts("Pulls", [*quantiles("rolloutd_pull_seconds", NODE, qs=(0.5, 0.9)),
                 *[(q, "rebuild " + legend) for q, legend in
                   quantiles("rolloutd_pull_reconstruct_seconds", NODE, qs=(0.9,))],
                 (f"sum by (result) (increase(rolloutd_pulls_total{{{NODE}}}[{RATE}]))", "{{result}}")],
       description="whole-pull durations (s), a delta pull's rebuild from its base (s), and pulls by result"),
    ts("Pull rate", [(f"sum(rolloutd_pull_rate_bytes_per_second{{{NODE}}})", "now, all nodes"),
                     (f"sum by (kind) (rate(rolloutd_pull_bytes_total{{{NODE}}}[{RATE}]))", "average, {{kind}}")],
       unit="Bps", description="bytes fetched over the network; delta: versions that came as deltas on a base"),
    ts("Updates and failures",
       [(f"sum(increase(rolloutd_updates_total{{{NODE}}}[{RATE}]))", "updates"),
        (f"sum by (kind) (increase(rolloutd_update_failures_total{{{NODE}}}[{RATE}])) > 0", "failed: {{kind}}"),
        (f"sum by (instance, server) (increase(rolloutd_server_restarts_total{{{NODE}}}[{RATE}])) > 0",
         "restart {{instance}} {{server}}")]),
    ts("Gate: max |served − expected| logprob",
       [(f"max by (instance, server) (rolloutd_gate_max_abs_dlogprob{{{NODE}}})", "{{instance}} {{server}}")],
       description="the last gate of each server against the version's canary"),
    ts("Registry contact from the nodes",
       [(f"count(rolloutd_registry_reachable{{{NODE}}} == 0) or vector(0)", "nodes not reaching it"),
        (f"sum(rate(rolloutd_heartbeat_failures_total{{{NODE}}}[{RATE}]))", "failed heartbeats / s"),
        (f"sum by (task) (increase(rolloutd_task_errors_total{{{NODE}}}[{RATE}])) > 0", "task crash: {{task}}")]),
    ts("Gateways", [(f"sum by (code) (rate(rolloutd_gateway_requests_total{{{NODE}}}[{RATE}]))", "{{code}}"),
                    (f"sum(rate(rolloutd_gateway_held_total{{{NODE}}}[{RATE}]))", "held by a pause"),
                    (f"sum(rate(rolloutd_gateway_refused_connections_total{{{NODE}}}[{RATE}]))",
                     "connections refused")], unit="reqps"),
    ts("Mirror", [(f"rolloutd_mirror_bytes{{{NODE}}}", "{{instance}}"),
                  (f"rolloutd_mirror_spare_bytes{{{NODE}}}", "{{instance}} spare, for the next pull")], unit="bytes"),
]


def variable(name: str, label: str, query: str) -> dict:
    return {"name": name, "label": label, "type": "query", "datasource": DS, "definition": query,
            "query": {"query": query, "refId": f"{name}-var"}, "refresh": 2, "multi": True, "includeAll": True,
            "allValue": ".*", "current": {"text": "All", "value": "$__all"}, "sort": 1}


def dashboard() -> dict:
    panels, x, y, height = [], 0, 0, 0
    for i, p in enumerate(PANELS):
        p = dict(p)
        w = p.pop("_w")
        h = 1 if p["type"] == "row" else 4 if p["type"] == "stat" else 8
        if x + w > 24 or p["type"] == "row":
            x, y = 0, y + height
            height = 0
        p["gridPos"] = {"x": x, "y": y, "w": w, "h": h}
        p["id"] = i + 1
        panels.append(p)
        x, height = x + w, max(height, h)
    return {
        "title": "rolloutd", "uid": "rolloutd", "description": "The registry's fleet and every node's daemon",
        "tags": ["rolloutd"], "timezone": "browser", "schemaVersion": 39, "version": 1, "editable": True,
        "refresh": "30s", "time": {"from": "now-6h", "to": "now"}, "graphTooltip": 1,
        "templating": {"list": [
            {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0},
            variable("registry", "registry", "label_values(rolloutd_registry_latest_version, instance)"),
            variable("node", "node", "label_values(rolloutd_server_version, instance)"),
        ]},
        "annotations": {"list": []}, "links": [], "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 when the committed file is stale")
    args = p.parse_args(argv)
    path = ROOT / OUT
    if args.check:
        if not path.exists() or path.read_text() != render():
            print(f"{OUT} is stale: run python scripts/grafana.py", file=sys.stderr)
            return 1
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render())
    print(f"wrote {OUT} ({len(PANELS)} panels)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
