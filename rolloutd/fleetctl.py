"""``rolloutd fleet --registry URL``: the fleet page (``GET /ui``) as a terminal table, for the
trainer's host; ``--json`` prints the ``GET /v1/fleet`` document with every page of nodes.

Contract: exits 0 when the registry answered, 1 otherwise with one line on stderr (no traceback).
The table is a few summary lines, the versions with their publish-to-serving figures, then one row
per replica, grouped by node (its node's last pull: full or delta, the share of the version's size
it fetched, the seconds its rebuild from the base took); ``--problems`` keeps only replicas with a
problem.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rolloutd.units import age, percent, size
from rolloutd.units import version_label as ver

PAGE_NODES = 1000  # nodes asked per request; the command asks until it has every page
ERROR_WIDTH = 60
VERSION_COLUMNS = ("VERSION", "STATE", "PUBLISHED", "SIZE", "LEASES", "SERVING", "HELD BY", "REACHED",
                   "P50", "P90", "MAX")
REPLICA_COLUMNS = ("NODE", "SERVER", "STATE", "VERSION", "BEHIND", "TARGET", "PAUSE", "PULL", "FETCHED",
                   "REBUILD", "GATE", "HEARTBEAT", "STARTS", "PROBLEMS", "LAST ERROR")
PROBLEM_WORDS = {"state": "failed", "gate": "gate", "silent": "silent"}


def add_parser(sub) -> None:
    p = sub.add_parser("fleet", help="show every replica of a registry's fleet: state, version, lag, "
                       "pauses, problems")
    p.add_argument("--registry", required=True, help="registry URL, e.g. http://trainer:8700")
    p.add_argument("--token-file", type=Path, help="file holding the registry's bearer token")
    p.add_argument("--json", action="store_true", help="print the GET /v1/fleet document (every page)")
    p.add_argument("--node", default="", help="only nodes whose name contains this")
    p.add_argument("--state", default="", help="only replicas in this state (e.g. BACKOFF)")
    p.add_argument("--problems", action="store_true", help="only replicas with a problem (failed, gate "
                   "failed, or silent)")
    p.add_argument("--stale-s", type=float, default=15.0, help="a replica silent this long has a problem")
    p.add_argument("--timeout-s", type=float, default=30.0, help="per-request timeout")
    p.set_defaults(func=cmd_fleet)


def cmd_fleet(args: argparse.Namespace) -> int:
    from rolloutd.trainer.publish import RegistryHTTP
    token = args.token_file.read_text().strip() if args.token_file else None
    reg = RegistryHTTP(args.registry, token, timeout_s=args.timeout_s)
    try:
        doc = fetch_all(reg, node=args.node, state=args.state, problems="true" if args.problems else None,
                        stale_s=args.stale_s)
    finally:
        reg.close()
    print(json.dumps(doc, indent=2) if args.json else render_fleet(doc, args.registry))
    return 0


def fetch_all(reg, **query) -> dict:
    """Every page of nodes in one document (the first page's figures; the nodes of all pages)."""
    doc = reg.fleet(page=1, per_page=PAGE_NODES, **query)
    nodes = doc["nodes"]
    while nodes["page"] < doc["nodes"]["pages"]:
        nodes = reg.fleet(page=nodes["page"] + 1, per_page=PAGE_NODES, **query)["nodes"]
        doc["nodes"]["items"] += nodes["items"]
    doc["nodes"].update(page=1, per_page=max(1, len(doc["nodes"]["items"])), pages=1)
    return doc


# -- the table -------------------------------------------------------------------------------------------

def render_fleet(doc: dict, url: str) -> str:
    lines = [*_summary(doc, url), ""]
    lines += _table(VERSION_COLUMNS, [_version_row(v, doc["rollouts"]) for v in reversed(doc["versions"])])
    if not doc["versions"]:
        lines.append("(nothing published)")
    lines.append("")
    rows = [_replica_row(n["node"], r) for n in doc["nodes"]["items"] for r in n["replicas"]]
    lines += _table(REPLICA_COLUMNS, rows)
    if not rows:
        lines.append("(no replica matches)" if doc["summary"]["replicas"] else "(no replica has reported)")
    return "\n".join(lines)


def _summary(doc: dict, url: str) -> list[str]:
    s, latest = doc["summary"], doc["latest"]
    newest = f"newest {ver(latest['version'])}, published {age(latest['published_age_s'])} ago" if latest \
        else "nothing published"
    demand = f"demand {ver(doc['demand'])}" if doc["demand"] is not None else "no demand"
    states = ", ".join(f"{n} {state.lower()}" for state, n in s["by_state"].items()) or "none"
    b = s["behind"]
    return [f"registry {url} (instance {doc['instance']}): {newest}; {demand}",
            f"replicas {s['replicas']} on {s['nodes']} nodes: {states}; {s['with_problems']} with problems "
            f"({s['silent']} silent over {doc['stale_s']:g} s)",
            f"on the newest version {b['0']}; one behind {b['1']}; two {b['2']}; three or more {b['3+']}; "
            f"start model {b['start model']}"]


def _table(columns: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    rows = [columns, *rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(columns))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]


def _version_row(v: dict, rollouts: list[dict]) -> tuple[str, ...]:
    r = next((r for r in rollouts if r["version"] == v["version"]), None) or {}
    return (ver(v["version"]), v["state"], f"{age(v['published_age_s'])} ago", size(v["total_bytes"]),
            str(v["leases"]), str(v["serving"]), str(v["held_by"]), str(r.get("reached", "-")),
            _secs(r.get("p50_s")), _secs(r.get("p90_s")), _secs(r.get("max_s")))


def _replica_row(node: str, r: dict) -> tuple[str, ...]:
    if r["version"] is None:
        behind = "start model"
    elif r["lag"] is None:
        behind = "?"
    else:
        behind = str(r["lag"]) + (f" ({age(r['lag_s'])})" if r["lag"] else "")
    gate = "-" if r["gate"] is None else ("ok" if r["gate"]["ok"] else "FAILED")
    error = " ".join((r["error"] or "-").split())
    if len(error) > ERROR_WIDTH:
        error = error[:ERROR_WIDTH - 1] + "…"
    problems = ",".join(PROBLEM_WORDS.get(p, p) for p in r["problems"]) or "-"
    return (node, r["server"], f"{r['state']} {age(r['state_age_s'])}",
            "base" if r["version"] is None else ver(r["version"]), behind, ver(r["target"]),
            _secs(r["paused_s"]), _secs(r["pull_s"]), fetched(r.get("pull")),  # absent from older registries
            _secs((r.get("pull") or {}).get("reconstruct_s")), gate, f"{age(r['age_s'])} ago",
            str(r["incarnation"]), problems, error)


def fetched(pull: dict | None) -> str:
    """The last pull in a narrow cell: how it came and the share of the version's size it fetched
    ("delta 2.1% on v6"; "full"; "full 40%" when an earlier try had fetched the rest)."""
    if pull is None:
        return "-"
    ratio = pull.get("fetched_ratio")
    if pull["bytes_fetched"] == 0:
        return "held"  # the mirror had the version: nothing fetched
    share = "?" if ratio is None else percent(ratio)
    if pull["kind"] == "delta":
        return f"delta {share}" + (f" on {ver(pull['base'])}" if pull.get("base") is not None else "")
    whole = "full" if ratio is None or ratio >= 1 else f"full {share}"
    return whole + (" (delta failed)" if pull.get("delta_error") else "")



def _secs(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{1000 * s:.0f}ms" if s < 1 else age(s)
