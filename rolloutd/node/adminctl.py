"""The admin API's client side: ``rolloutd status``, ``restart``, ``update`` and ``reload``.

Contract: each command talks to a running daemon's admin API (``rolloutd.node.admin``) and exits 0
when the daemon answered yes, 1 otherwise, with one line on stderr saying why (no traceback).
The API's address is ``--url``, else the config file's ``admin.host``/``admin.port`` (``-c``,
or the default config file when it is readable), else ``http://127.0.0.1:9100``. Actions send
the token from ``--token-file``, else from the config's ``admin.token_file``, else from
``<state_dir>/admin.token`` that the daemon writes at start (readable by root and rolloutd's
user only: other local users cannot act), when readable.
``rolloutd status`` prints a table (``render_status``), or the raw document with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import httpx

from rolloutd.units import age, percent, size, version_label

DEFAULT_URL = "http://127.0.0.1:9100"
ERROR_WIDTH = 60  # the ERROR column is cut here; `--json` has the whole message
COLUMNS = ("NAME", "STATE", "PID", "PORT", "GPUS", "VERSION", "TARGET", "RESTARTS", "UPDATED", "HEARTBEAT", "ERROR")


def add_parsers(sub) -> None:
    """Register ``status``, ``restart``, ``update`` and ``reload`` on the cli's subparsers."""
    p = sub.add_parser("status", help="show the node daemon's servers, target, pull and registry")
    _common_args(p)
    p.add_argument("--json", action="store_true", help="print the admin API's status document as JSON")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("restart", help="restart one server of the running daemon")
    p.add_argument("server", help="the server's name in the config")
    _common_args(p, token=True)
    p.set_defaults(func=cmd_restart)

    p = sub.add_parser("update", help="ask the running daemon to check the registry for a new version now")
    _common_args(p, token=True)
    p.set_defaults(func=cmd_update)

    p = sub.add_parser("reload", help="ask the running daemon to re-read its config file (like SIGHUP)")
    _common_args(p, token=True)
    p.set_defaults(func=cmd_reload)


def _common_args(p: argparse.ArgumentParser, token: bool = False) -> None:
    p.add_argument("--url", help=f"the admin API (default: from the config file, else {DEFAULT_URL})")
    p.add_argument("-c", "--config", type=Path, default=None, metavar="FILE",
                   help="config file naming the admin address (default: the daemon's, when readable)")
    p.add_argument("--timeout-s", type=float, default=10.0, help="wait this long for an answer")
    if token:
        p.add_argument("--token-file", type=Path, help="file holding the admin token (default: the config's "
                       "admin.token_file, else <state_dir>/admin.token that the daemon writes, when readable)")


# -- where the daemon is -------------------------------------------------------------------------------

@dataclass
class Endpoint:
    url: str
    token: str | None = None
    notes: list[str] = field(default_factory=list)  # why a default was not taken, for error messages


def resolve(args: argparse.Namespace, with_token: bool = False) -> Endpoint:
    """The admin URL and token from the flags, else the config file, else the defaults."""
    cfg, note = _config(args.config)
    admin = cfg.admin if cfg else None
    ep = Endpoint(args.url.rstrip("/") if args.url else _url_of(admin) if admin else DEFAULT_URL)
    if note:
        ep.notes.append(note)
    if with_token:
        path = args.token_file or _token_path(cfg)
        if path is not None:
            try:
                ep.token = Path(path).read_text().strip() or None
            except (OSError, UnicodeDecodeError) as e:
                why = getattr(e, "strerror", None) or e
                if args.token_file:
                    raise OSError(f"cannot read the token file {path}: {why}") from None
                ep.notes.append(f"cannot read the admin token {path} ({why}): actions need it; root and "
                                "rolloutd's user can read it")
    return ep


def _token_path(cfg) -> Path | None:
    """The config's admin token file, or the daemon's default one when no config is at hand."""
    if cfg is not None:
        return cfg.admin_token_path
    try:
        from rolloutd.config import ADMIN_TOKEN_NAME, Config
    except ImportError:
        return None
    return Config.model_fields["state_dir"].default / ADMIN_TOKEN_NAME


def _config(path: Path | None):
    """The config and a note when a file given on the command line is unusable."""
    try:
        from rolloutd.config import DEFAULT_CONFIG_PATH, load_config
    except ImportError:  # an older build without the config module: the defaults still work
        return None, None
    explicit = path is not None
    path = path or DEFAULT_CONFIG_PATH
    if not explicit and not path.is_file():
        return None, None
    try:
        return load_config(path), None
    except Exception as e:  # noqa: BLE001 - any unusable file falls back to the defaults
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        return None, f"{path} was not used ({first})" if explicit else None


def _url_of(admin) -> str:
    # A daemon listening on every address is reached on loopback.
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(admin.host, admin.host)
    return f"http://[{host}]:{admin.port}" if ":" in host else f"http://{host}:{admin.port}"


# -- talking to it ---------------------------------------------------------------------------------------

class AdminUnreachable(Exception):
    pass


def call(ep: Endpoint, method: str, path: str, timeout_s: float) -> httpx.Response:
    headers = {"Authorization": f"Bearer {ep.token}"} if ep.token else {}
    try:
        with httpx.Client(timeout=timeout_s) as client:
            return client.request(method, ep.url + path, headers=headers)
    except httpx.HTTPError as e:
        raise AdminUnreachable(f"cannot reach the admin API at {ep.url}: {str(e) or type(e).__name__}") from None


def error_message(resp: httpx.Response) -> str:
    """The API's error message, or the HTTP status when the answer is not the API's JSON."""
    try:
        err = resp.json()["error"]
        return f"{err['message']} ({resp.status_code} {err['code']})"
    except (ValueError, KeyError, TypeError):
        return f"HTTP {resp.status_code} from the admin API: {resp.text[:200]}"


def _fail(message: str, ep: Endpoint | None = None) -> int:
    print(f"rolloutd: {message}", file=sys.stderr)
    for note in ep.notes if ep else ():
        print(f"rolloutd: note: {note}", file=sys.stderr)
    return 1


def cmd_status(args: argparse.Namespace) -> int:
    ep = resolve(args)
    try:
        resp = call(ep, "GET", "/status", args.timeout_s)
    except AdminUnreachable as e:
        return _fail(str(e), ep)
    if resp.status_code != 200:
        return _fail(error_message(resp), ep)
    status = resp.json()
    print(json.dumps(status, indent=2) if args.json else render_status(status))
    return 0


def _action(args: argparse.Namespace, path: str) -> int:
    ep = resolve(args, with_token=True)
    try:
        resp = call(ep, "POST", path, args.timeout_s)
    except AdminUnreachable as e:
        return _fail(str(e), ep)
    if resp.status_code != 200:
        return _fail(error_message(resp), ep)
    print(resp.json()["message"])
    return 0


def cmd_restart(args: argparse.Namespace) -> int:
    return _action(args, f"/servers/{quote(args.server, safe='')}/restart")


def cmd_update(args: argparse.Namespace) -> int:
    return _action(args, "/update")


def cmd_reload(args: argparse.Namespace) -> int:
    return _action(args, "/reload")


# -- the table -------------------------------------------------------------------------------------------

def render_status(st: dict, now_unix: float | None = None) -> str:
    """The status document as a few summary lines and one row per server."""
    now_unix = time.time() if now_unix is None else now_unix
    lines = [_node_line(st), _registry_line(st["registry"]), _target_line(st["target"]), _pull_line(st["pull"]),
             _mirror_line(st["mirror"]), ""]
    rows = [COLUMNS] + [_server_row(s, now_unix) for s in st["servers"]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    for row in rows:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    if not st["servers"]:
        lines.append("(no servers configured)")
    lines += _refused_lines(st.get("refused") or [], st.get("last_good"))
    lines += _reload_lines(st.get("reload"))
    return "\n".join(lines)


def _refused_lines(refused: list[dict], last_good: int | None) -> list[str]:
    """The versions the node refused: its servers serve their last good version instead (one with
    none of its own, the node's)."""
    lines = []
    for r in refused:
        reason = " ".join(r["reason"].split())
        lines.append(f"refused v{r['version']} ({r['server']}, serving its last good version): "
                     f"{reason if len(reason) <= 100 else reason[:99] + '…'}")
    if lines:
        lines.append(f"the node's last good version: {'v' + str(last_good) if last_good is not None else 'none'}")
    return [""] + lines if lines else []


def _reload_lines(r: dict | None) -> list[str]:
    """What the config file says that does not run: a refused reload, sections kept until a restart."""
    if r is None:
        return []
    out = []
    if r["ok"] is False:
        first = (r["error"] or "").splitlines()[0] if r["error"] else "?"
        out.append(f"reload refused: configuration error at {r['where']}, running the previous one ({first})")
    if r.get("needs_restart"):
        out.append(f"reload: {', '.join(r['needs_restart'])} changed in the file; they take effect when rolloutd "
                   "restarts")
    return [""] + out if out else []


def _node_line(st: dict) -> str:
    ready = "ready" if st["ready"] else "not ready"
    return (f"node {st['node']}: rolloutd {st['rolloutd_version']}, pid {st['pid']}, "
            f"up {age(st['uptime_s'])}, {ready}")


def _registry_line(r: dict) -> str:
    parts = [f"registry {r['url']}: {'reachable' if r['reachable'] else 'UNREACHABLE'}"]
    if r["instance"]:
        parts.append(f"instance {r['instance']}")
    parts.append(f"latest {version_label(r['latest'])}")
    if r["demand"] is not None:
        parts.append(f"demand {version_label(r['demand'])}")
    if r["last_contact_age_s"] is not None:
        parts.append(f"answered {age(r['last_contact_age_s'])} ago")
    if r["last_error"]:
        parts.append(f"error: {r['last_error']}")
    return ", ".join(parts)


def _target_line(t: dict | None) -> str:
    return f"target {version_label(t['version'])} (digest {t['digest']})" if t else "target: none yet"


def _delta_part(p: dict) -> str:
    """What a delta pull fetched against the version's size (absent from daemons before deltas)."""
    if p.get("kind") == "delta":
        share = f" ({percent(p['bytes_fetched'] / p['version_bytes'])})" if p.get("version_bytes") else ""
        rebuilt = f", rebuilt in {p['reconstruct_s']:.2f} s" if p.get("reconstruct_s") is not None else ""
        return f"; a delta on {version_label(p['base'])}: fetched {size(p['bytes_fetched'])} " \
            f"of {size(p['version_bytes'])}{share}{rebuilt}"
    return "; whole, its delta failed" if p.get("delta_error") else ""


def _pull_line(p: dict | None) -> str:
    if p is None:
        return "pull: none yet"
    name = version_label(p["version"]) if p["version"] is not None else str(p["target"])
    state, done, total = p["state"], p["bytes_done"], p["bytes_total"]
    line = f"pull {name}: {state}, {size(done)} of {size(total)}"
    if state == "pulling":
        pct = 100 * done / total if total else 0
        eta = f"ETA {age(p['eta_s'])}" if p["eta_s"] is not None else "ETA unknown"
        line += f" ({pct:.0f}%), {size(p['rate_bytes_per_s'])}/s, {eta}"
        if p.get("workers"):
            line += f", {len(p['workers'])} workers"
    else:
        line += f" in {p['seconds']:.1f} s"
        if state == "done" and p["seconds"] > 0:
            line += f" ({size(p['rate_bytes_per_s'])}/s)"
    if p.get("bytes_resumed"):
        line += f", {size(p['bytes_resumed'])} kept from the last try"
    if p["retries"]:
        line += f", {p['retries']} retries"
    if p.get("worker_restarts"):
        line += f", {p['worker_restarts']} worker restarts"
    line += _delta_part(p)
    if p["error"]:
        line += f": {p['error']}"
    return line


def _mirror_line(m: dict) -> str:
    versions = ", ".join(version_label(v) for v in m["versions"]) or "none"
    spare = f" ({size(m['spare_bytes'])} spare, for the next pull)" if m.get("spare_bytes") else ""
    return f"mirror {m['dir']}: {size(m['usage_bytes'])} of {size(m['max_bytes'])}{spare}, versions {versions}"


def _server_row(s: dict, now_unix: float) -> tuple[str, ...]:
    upd = s["last_update"]
    if upd is None:
        updated = "-"
    else:
        updated = f"{age(max(0.0, now_unix - upd['at_unix']))} ago" + ("" if upd["ok"] else " (failed)")
    beat = "-" if s["heartbeat_age_s"] is None else f"{age(s['heartbeat_age_s'])} ago"
    error = " ".join((s["last_error"] or "-").split())
    if len(error) > ERROR_WIDTH:
        error = error[:ERROR_WIDTH - 1] + "…"
    return (s["name"], f"{s['state']} {age(s['state_age_s'])}", _dash(s["pid"]), str(s["public_port"]),
            ",".join(map(str, s["gpus"])) or "-", version_label(s["version"]) if s["version"] is not None else "base",
            version_label(s["target"]), str(s["restarts"]), updated, beat, error)


def _dash(x) -> str:
    return "-" if x is None else str(x)
