"""``rolloutd demo``: the whole job on one machine without a GPU, in about a minute.

An embedded registry; a small Qwen2-shaped model with tied embeddings built here (no model
hub; the shape of the small Qwen and Llama models RL post-trains); the daemon with one real
``vllm serve`` (vLLM's CPU build) started on that model; then the trainer publishes three
versions from the model in memory (``publish(version, model.state_dict())``, each with a
canary; version 3 is one RL-like step after version 2, and the registry sends it as a delta: the
node fetches what changed and rebuilds the rest from version 2, as its /status shows), and the
demo shows, from the admin API and from generations through the gateway, that the server
switched to each: its greedy outputs **equal** transformers' greedy decoding of the published
weights, computed here, every token is labelled with the version that produced it, and the
server's canary figure is within its tolerance. The daemon stops at the end, and no
process of it is left.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shutil
import socket
import tempfile
from pathlib import Path

import httpx

from rolloutd.config import Config
from rolloutd.demo import families
from rolloutd.demo.cpu_vllm import CPU_ENV, cpu_args
from rolloutd.node.adminctl import render_status
from rolloutd.node.daemon import Daemon
from rolloutd.trainer.publish import EmbeddedRegistry
from rolloutd.units import percent

FAMILY = "qwen2"
PROMPT = [1, 5, 9, 13, 40]
NEW_TOKENS = 12
ROOT = Path(__file__).resolve().parents[2]  # the repository (rolloutd/demo/serve.py)


def say(msg: str) -> None:
    print(f"demo: {msg}", flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_vllm() -> str:
    """The vLLM of the project's own environment when there is one, else ``vllm`` on PATH."""
    local = ROOT / ".venv-vllm" / "bin" / "vllm"
    return str(local) if local.exists() else "vllm"


def demo_config(work: Path, registry_url: str, vllm: str, model: Path) -> Config:
    return Config.model_validate({
        "node": {"name": "demo-node", "advertise_host": "127.0.0.1"},
        "registry": {"url": registry_url, "long_poll_s": 10},
        "admin": {"port": _free_port()},
        "gateway": {"host": "127.0.0.1"},
        "state_dir": str(work / "state"),
        "mirror": {"dir": str(work / "mirror"), "max_bytes": "256MiB"},
        "heartbeat": {"interval_s": 1},
        "health": {"interval_s": 1},
        "restart": {"start_timeout_s": 300},
        "vllm": {"command": [vllm, "serve"],
                 "args": cpu_args(), "env": dict(CPU_ENV)},
        "servers": [{"name": "cpu0", "model": str(model), "public_port": _free_port()}],
    })


async def _status(admin: str) -> dict:
    async with httpx.AsyncClient(timeout=10) as c:
        return (await c.get(admin + "/status")).json()


async def _wait_serving(admin: str, version: int, timeout_s: float) -> dict:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    last = None
    while loop.time() < deadline:
        try:
            st = await _status(admin)
        except httpx.HTTPError:
            st = None
        if st is not None:
            s = st["servers"][0]
            now = (s["state"], s["version"])
            if now != last:
                say(f"server cpu0 is {now[0]}" + (f" on version {now[1]}" if now[1] else ""))
                last = now
            if now == ("SERVING", version):
                return st
        await asyncio.sleep(0.5)
    raise TimeoutError(f"the server was not serving version {version} within {timeout_s:.0f} s")


async def _generate(endpoint: str) -> dict:
    """Generation as a trainer does it: at the endpoint the registry lists (the server's gateway)."""
    async with httpx.AsyncClient(timeout=60) as c:
        r = await c.post(f"{endpoint}/inference/v1/generate", json={
            "token_ids": PROMPT, "stream": False,
            "sampling_params": {"max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}})
        r.raise_for_status()
        return r.json()["choices"][0]


def _show(st: dict, gen: dict, want: list[int]) -> None:
    s = st["servers"][0]
    update = s["last_update"] or {}
    phases = update.get("phases_s", {})
    gate = update.get("gate") or {}
    say(f"status: {s['name']} {s['state']} version {s['version']} (incarnation {s['incarnation']}, pid {s['pid']}); "
        f"last update: " + (", ".join(f"{k} {v * 1000:.0f} ms" for k, v in phases.items()) or "none"))
    if gate.get("canary"):
        say(f"gate: the version's canary scored on the server: max |dlogprob| {gate['max_abs_dlogprob']:.2g} "
            f"(tolerance {gate['tolerance']:g})")
    say(f"generate at {s['endpoint']} (the gateway) {PROMPT} -> {gen['token_ids']}  "
        f"weight_versions {json.dumps(gen['weight_versions'])}")
    say(f"transformers on the published weights  -> {want}: "
        + ("equal" if gen["token_ids"] == want else "DIFFERENT"))


def _trainer_model(version: int, before):
    """The trainer's model at ``version``: versions 1 and 2 from seeds of their own (every weight
    differs: the registry sends them whole); version 3 one RL-like step after version 2 (2 % of the
    weights move: the registry sends it as a delta on version 2)."""
    if version < 3:
        return families.hf_model(FAMILY, version)
    return families.sparse_step(before, version, [PROMPT], NEW_TOKENS)


def _published_as(m) -> str:
    if m.delta is None:
        return "the registry sends it whole"
    return (f"the registry sends it as a delta on version {m.delta.base_version}: "
            f"{m.delta.total_bytes / 2**10:.0f} KiB for {m.total_bytes / 2**10:.0f} KiB "
            f"({percent(m.delta.total_bytes / m.total_bytes)})")


def _show_pull(p: dict) -> None:
    """How the node got the version, from its /status: whole, or rebuilt from a delta."""
    if p["kind"] == "delta":
        share = percent(p["bytes_fetched"] / p["version_bytes"])
        say(f"node: pulled version {p['version']} as a delta on version {p['base']}: fetched "
            f"{p['bytes_fetched']} bytes of its {p['version_bytes']} ({share}), "
            f"rebuilt and checked chunk by chunk in {p['reconstruct_s'] * 1000:.0f} ms")
    else:
        say(f"node: pulled version {p['version']} whole: fetched {p['bytes_fetched']} bytes of its "
            f"{p['version_bytes']}" + (f" (its delta failed: {p['delta_error']})" if p["delta_error"] else ""))


async def _drive(daemon: Daemon, reg: EmbeddedRegistry, timeout_s: float) -> list[bool]:
    """Publish versions 1, 2, 3 as a trainer does; for each, whether the server's outputs equal
    transformers' on the published weights."""
    from rolloutd.trainer.canary import make_canary

    while not hasattr(daemon, "admin") or not daemon.admin.started:
        await asyncio.sleep(0.1)
    admin = f"http://127.0.0.1:{daemon.admin.port}"
    exact = []
    model = None
    for version in (1, 2, 3):
        model = await asyncio.to_thread(_trainer_model, version, model)
        canary = await asyncio.to_thread(make_canary, model, PROMPT)
        await asyncio.to_thread(reg.publish, version, model.state_dict(), canary=canary)
        m = await asyncio.to_thread(reg.manifest, version)  # as the registry published it: whole or a delta
        say(f"trainer: published version {version} ({m.total_bytes / 2**20:.1f} MiB in {len(m.files)} files, "
            f"with a canary); " + _published_as(m))
        st = await _wait_serving(admin, version, timeout_s)
        _show_pull(st["pull"])
        gen = await _generate(st["servers"][0]["endpoint"])
        want = (await asyncio.to_thread(families.greedy, model, [PROMPT], NEW_TOKENS))[0]
        _show(st, gen, want)
        exact.append(gen["token_ids"] == want)
        assert gen["weight_versions"][0]["version"] == str(version), gen
    print(f"\n$ rolloutd status --url {admin}\n{render_status(st)}\n", flush=True)
    return exact


async def _run(args: argparse.Namespace, work: Path) -> int:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the terminal tells the story; bars of saving 1 MiB add nothing
    say(f"building a small {FAMILY} model with tied embeddings in {work}")
    model = await asyncio.to_thread(families.build, work / "start-model", FAMILY, 0)
    with EmbeddedRegistry(port=0) as reg:
        say(f"registry: listening on {reg.url}")
        cfg = demo_config(work, reg.url, args.vllm, model)
        daemon = Daemon(cfg, None)
        say(f"daemon: admin API on http://127.0.0.1:{cfg.admin.port}/status; starting vllm serve "
            f"(about 30 s on CPU)")
        run = asyncio.create_task(daemon.run())
        try:
            exact = await _drive(daemon, reg, args.timeout_s)
        finally:
            daemon.request_stop()
            await run
    if not all(exact):
        say("FAILED: the served outputs differ from transformers' on the published weights")
        return 1
    say("done: the server followed versions 1 -> 2 -> 3 without a restart; at each, its outputs equal "
        "transformers' on the published weights, and each token is labelled with the version that produced it")
    return 0


def run_demo(args: argparse.Namespace) -> int:
    from rolloutd.httpserver import run
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="rolloutd-demo-"))
    # The log outlives a temporary work directory: next to it, not in it.
    log_path = work / "demo.log" if args.workdir else work.with_name(work.name + ".log")
    if not args.live_logs:
        _log_to(log_path)
    say(f"the daemon's and vLLM's logs: {log_path}" + ("" if args.live_logs else " (--verbose shows them here)"))
    try:
        return run(_run(args, work))
    except (Exception, KeyboardInterrupt) as e:
        say(f"FAILED: {type(e).__name__}: {e} (the daemon's and vLLM's logs: {log_path})")
        raise
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


def _log_to(path: Path) -> None:
    """Every log line (the daemon's, and vLLM's as the daemon relays them) to ``path``: the
    terminal keeps the story."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for h in root.handlers[:]:
        root.removeHandler(h)
    root.addHandler(handler)


def add_parser(sub) -> argparse._SubParsersAction:
    """``rolloutd demo``; returns its subcommands, where the CLI adds ``rolloutd demo rl``."""
    p = sub.add_parser("demo", help="run the whole job on this machine: registry, daemon, a CPU vLLM server")
    p.add_argument("--vllm", default=default_vllm(), help="the vllm command (default: %(default)s)")
    p.add_argument("--workdir", help="keep the models, mirror and state here (default: a temporary directory)")
    p.add_argument("--timeout-s", type=float, default=300, help="longest wait for each version")
    p.add_argument("--verbose", dest="live_logs", action="store_true",
                   help="show the daemon's and vLLM's logs here as they come (default: in a file it names)")
    p.set_defaults(func=run_demo)
    # `rolloutd demo rl` and `rolloutd demo trl`: the trainer's side, learning through the fleet
    # (rolloutd/demo/rl.py, trl.py)
    return p.add_subparsers(dest="demo", metavar="[rl|trl]", required=False)
