"""A fake ``vllm serve`` for fault tests: the routes of vLLM's dev mode that rolloutd calls, and
faults a real server cannot be made to show. It is not vLLM: it loads no model.

    python tests/support/fake_vllm.py serve MODEL --uds PATH [other vllm args, ignored]

It listens on the UNIX socket ``--uds`` as rolloutd starts vLLM (``--host``/``--port``: on TCP
instead, for a test that wants one).

Standard library and aiohttp only. Routes (JSON): ``GET /health``, ``POST /pause?mode=``,
``POST /resume``, ``GET /is_paused``, ``POST /reset_prefix_cache``, ``POST /start_weight_update``,
``POST /update_weights``
``{"update_info": {"path", "digest"}}`` (the mirror directory is checked by the plugin's own
``check_version``), ``POST /finish_weight_update {"weight_version"}`` (sets the label only
while an update is started), ``GET /weight_info``, ``POST /inference/v1/generate`` (token ids
derived from the label and the prompt, so a test sees which weights answer; it waits while the
server is paused), ``GET /v1/models``, ``POST /v1/completions`` with ``prompt_logprobs`` (the
gate's request: every prompt position after the first gets logprob -1.0, or the value of the
fault ``logprob=X``, e.g. ``logprob=nan``; it waits while paused). With ``--data-parallel-size N``
it stands for N engines: ``/v1/completions`` is answered by the engine its header
``X-data-parallel-rank`` names (HTTP 400 outside ``[0, N)``, as vLLM), else by engine 0, where
vLLM's balancer sends the requests of an idle server. Errors are HTTP 500
``{"error": {"message": ...}}``. ``POST /fake/health``
``{"ok": bool}`` lets a test make a running fake healthy or unhealthy; ``POST /fake/faults``
``{"faults": "fail=/pause"}`` replaces its faults while it runs (``""``: none); ``POST
/fake/engine_dies`` acts out vLLM's API server after its engine core died: the ``spawn_child``
child is killed, the listener closes, requests in flight are never answered, the process lives on.

Faults, from ``FAKE_VLLM_FAULTS`` (a comma list): ``never_healthy``, ``no_listen``,
``exit_at_start=CODE``, ``exit_after=SECONDS`` (status 1), ``ignore_term``,
``slow_start=SECONDS`` (before it listens), ``rank_logprob=RANK:X`` (engine RANK scores
every position X: an engine left on other weights), ``hang=/route``, ``fail=/route``,
``fail_once=/route``, ``crash_on=/route`` (exits with status 1), ``reload_unsupported``
(``/start_weight_update`` answers as the plugin refusing to load into this server), ``version_refused``
(``/update_weights`` answers as the plugin refusing a version that lacks a tensor), ``spawn_child`` (a ``sleep``
in its process group, as vLLM's engine core is; it inherits an ignored SIGTERM), ``escape_child``
(a ``sleep`` in a session of its own: out of the fake's process group, in its cgroup still).

Output: a startup line, then one line per request answered (``fake_vllm: POST /pause?mode=keep
-> 200``), or per request that will never be answered or crashes the fake.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import signal
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from aiohttp import web

try:
    from vllm_plugin.checkpoint import MirrorError, check_version
    from vllm_plugin.wire import RELOAD_UNSUPPORTED, VERSION_REFUSED
except ImportError:  # run from a checkout where rolloutd is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from vllm_plugin.checkpoint import MirrorError, check_version
    from vllm_plugin.wire import RELOAD_UNSUPPORTED, VERSION_REFUSED

PAUSE_MODES = ("abort", "wait", "keep")


def say(text: str) -> None:
    print(f"fake_vllm: {text}", flush=True)


def parse_faults(text: str) -> dict[str, list[str]]:
    """``"a,b=1,b=2"`` -> ``{"a": [""], "b": ["1", "2"]}``."""
    faults: dict[str, list[str]] = defaultdict(list)
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, _, value = item.partition("=")
        faults[key].append(value)
    return dict(faults)


class FakeVllm:
    def __init__(self, model: str, faults: dict[str, list[str]], engines: int = 1):
        self.model, self.faults, self.engines = model, faults, engines
        self.healthy = "never_healthy" not in faults
        self.paused = False
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.updating = False
        self.loaded_dir: str | None = None
        self.label = "default"
        self.failed_once: set[str] = set()
        self.site: web.BaseSite | None = None
        self.child: subprocess.Popen | None = None

    def routes(self, fault: str) -> set[str]:
        return set(self.faults.get(fault, ()))

    # -- faults on every route --------------------------------------------------------------------
    @web.middleware
    async def faulty(self, request: web.Request, handler) -> web.StreamResponse:
        route, line = request.path, f"{request.method} {request.path_qs}"
        if route in self.routes("crash_on"):
            die(f"{line} -> crashing (fault crash_on={route})")
        if route in self.routes("hang"):
            say(f"{line} -> never answered (fault hang={route})")
            await asyncio.Event().wait()
        if route in self.routes("fail") or (route in self.routes("fail_once") and route not in self.failed_once):
            self.failed_once.add(route)
            response = error(f"injected failure of {route}")
        else:
            try:
                response = await handler(request)
            except web.HTTPException as e:
                response = error(e.reason, e.status)
        say(f"{line} -> {response.status}")
        return response

    # -- routes -----------------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def set_health(self, request: web.Request) -> web.Response:
        self.healthy = bool((await body(request)).get("ok"))
        return web.json_response({"healthy": self.healthy})

    async def set_faults(self, request: web.Request) -> web.Response:
        self.faults = parse_faults(str((await body(request)).get("faults") or ""))
        return web.json_response({"faults": sorted(self.faults)})

    async def engine_dies(self, request: web.Request) -> web.Response:
        if self.child is not None:
            self.child.kill()
        self.healthy = False
        asyncio.get_running_loop().call_soon(self.site._server.close)  # listening ends; connections stay
        return web.json_response({"engine": "dead"})

    async def pause(self, request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")
        if mode not in PAUSE_MODES:
            return error(f"mode must be one of {PAUSE_MODES}, not {mode!r}", 400)
        self.paused = True
        self.resumed.clear()
        return web.json_response({"status": "paused"})

    async def resume(self, request: web.Request) -> web.Response:
        self.paused = False
        self.resumed.set()
        return web.json_response({"status": "resumed"})

    async def is_paused(self, request: web.Request) -> web.Response:
        return web.json_response({"is_paused": self.paused})

    async def start_weight_update(self, request: web.Request) -> web.Response:
        if "reload_unsupported" in self.faults:  # the plugin's refusal, as vLLM hands a worker's error on
            return error(f"Call to collective_rpc method failed: Worker failed with error '{RELOAD_UNSUPPORTED} "
                         "this server cannot reload its layers (fault reload_unsupported)'")
        self.updating = True
        return web.json_response({"message": "Weight update started"})

    async def update_weights(self, request: web.Request) -> web.Response:
        if not self.updating:
            return error("update_weights without start_weight_update")
        info = (await body(request)).get("update_info")
        if not isinstance(info, dict) or not isinstance(info.get("path"), str) or not isinstance(
                info.get("digest"), str):
            return error(f"update_info must be {{'path': str, 'digest': str}}, not {info!r}")
        try:
            check_version(info["path"], info["digest"])
        except MirrorError as e:
            return error(str(e))
        if "version_refused" in self.faults:  # the plugin's refusal of the version, before touching the model
            self.updating = False  # vLLM ends the update session on a failed update_weights
            return error(f"Call to collective_rpc method failed: Worker failed with error '{VERSION_REFUSED} "
                         f"{info['path']}: the version lacks 1 tensor(s) of the served model's checkpoint: "
                         "model.layers.1.self_attn.k_proj.weight (fault version_refused)'")
        self.loaded_dir = info["path"]
        return web.json_response({"message": "Weights updated"})

    async def finish_weight_update(self, request: web.Request) -> web.Response:
        if not self.updating:
            return error("finish_weight_update without start_weight_update")
        label = (await body(request)).get("weight_version")
        if label is not None and not isinstance(label, str):
            return error(f"weight_version must be a string, not {label!r}")
        self.updating = False
        self.label = label if label is not None else self.label
        return web.json_response({"message": "Weight update finished"})

    async def weight_info(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.label})

    async def generate(self, request: web.Request) -> web.Response:
        req = await body(request)
        prompt = req.get("token_ids") or []
        n = int((req.get("sampling_params") or {}).get("max_tokens") or 16)
        await self.resumed.wait()  # a paused server holds requests, as vLLM's "keep" mode does
        label = self.label
        tokens = token_ids(label, prompt, n)
        return web.json_response({
            "model": self.model, "output_mode": "tokens",
            "choices": [{"index": 0, "finish_reason": "length", "token_ids": tokens,
                         "weight_versions": [{"version": label, "start": 0, "end": len(tokens)}]}]})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def completions(self, request: web.Request) -> web.Response:
        req = await body(request)
        prompt = req.get("prompt")
        if req.get("model") != self.model:
            return error(f"The model `{req.get('model')}` does not exist.", 404)
        if not isinstance(prompt, list) or not prompt or not all(isinstance(t, int) for t in prompt):
            return error("the fake takes a prompt of token ids only", 400)
        rank = int(request.headers.get("X-data-parallel-rank", "0"))
        if not 0 <= rank < self.engines:  # vLLM's words
            return error(f"data_parallel_rank {rank} is out of range [0, {self.engines}).", 400)
        await self.resumed.wait()  # vLLM 0.32 queues new requests while paused
        value = float((self.faults.get("logprob") or ["-1.0"])[-1])
        for fault in self.faults.get("rank_logprob", ()):
            wrong, _, wrong_value = fault.partition(":")
            value = float(wrong_value) if int(wrong) == rank else value
        positions = [None] + [{str(t): {"logprob": value, "rank": 1, "decoded_token": f"<{t}>"}} for t in prompt[1:]]
        return web.json_response({"model": self.model, "choices": [
            {"index": 0, "text": "", "finish_reason": "length", "prompt_logprobs": positions}]})

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.faulty])
        app.add_routes([
            web.get("/health", self.health), web.post("/fake/health", self.set_health),
            web.post("/fake/faults", self.set_faults), web.post("/fake/engine_dies", self.engine_dies),
            web.post("/pause", self.pause), web.post("/resume", self.resume), web.get("/is_paused", self.is_paused),
            web.post("/start_weight_update", self.start_weight_update),
            web.post("/update_weights", self.update_weights),
            web.post("/finish_weight_update", self.finish_weight_update),
            web.get("/weight_info", self.weight_info), web.post("/inference/v1/generate", self.generate),
            web.get("/v1/models", self.models), web.post("/v1/completions", self.completions),
            web.post("/reset_prefix_cache", self.reset_prefix_cache)])
        return app

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        return web.json_response({"success": True})


def token_ids(label: str, prompt: list, n: int) -> list[int]:
    """Deterministic "generated" tokens: the same label and prompt give the same tokens."""
    seed = hashlib.sha256(f"{label}|{prompt}".encode()).digest()
    return [seed[i % len(seed)] * 4 + i % 4 for i in range(n)]


def error(message: str, status: int = 500) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


async def body(request: web.Request) -> dict:
    try:
        data = await request.json() if request.can_read_body else {}
    except ValueError:
        raise web.HTTPBadRequest(reason="the body is not JSON") from None
    if not isinstance(data, dict):
        raise web.HTTPBadRequest(reason="the body is not a JSON object")
    return data


# -- the process --------------------------------------------------------------------------------------
def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="fake_vllm", allow_abbrev=False)
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("model")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--uds", help="listen on this UNIX socket instead of --host/--port")
    parser.add_argument("--data-parallel-size", "-dp", type=int, default=1, help="the engines it stands for")
    args, _ignored = parser.parse_known_args(argv)
    return args


def die(why: str) -> None:
    say(why)
    os._exit(1)  # at once, as a crash would: no cleanup, no graceful shutdown


def first_seconds(faults: dict[str, list[str]], name: str) -> float | None:
    return float(faults[name][0]) if name in faults else None


async def serve(args: argparse.Namespace, faults: dict[str, list[str]], child: subprocess.Popen | None) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    if "ignore_term" not in faults:
        loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    if (after := first_seconds(faults, "exit_after")) is not None:
        loop.call_later(after, die, f"exiting with status 1 after {after:g} s (fault exit_after)")
    if (delay := first_seconds(faults, "slow_start")) is not None:
        say(f"starting slowly: {delay:g} s before listening (fault slow_start)")
        await asyncio.sleep(delay)
    if "no_listen" in faults:
        say("never listening (fault no_listen)")
        await stop.wait()
        return
    fake = FakeVllm(args.model, faults, args.data_parallel_size)
    fake.child = child
    runner = web.AppRunner(fake.app(), access_log=None, handle_signals=False)
    await runner.setup()
    if args.uds:
        fake.site, where = web.UnixSite(runner, args.uds), f"unix:{args.uds}"
    else:
        fake.site, where = web.TCPSite(runner, args.host, args.port), f"http://{args.host}:{args.port}"
    await fake.site.start()
    say(f"serving {args.model} on {where} (pid {os.getpid()}, faults: {','.join(faults) or 'none'})")
    try:
        await stop.wait()
    finally:
        say("stopping")
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    faults = parse_faults(os.environ.get("FAKE_VLLM_FAULTS", ""))
    say(f"starting {args.model} (pid {os.getpid()})")
    if "exit_at_start" in faults:
        code = int(faults["exit_at_start"][0] or 1)
        say(f"exiting with status {code} (fault exit_at_start)")
        return code
    if "ignore_term" in faults:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # before spawn_child: the child inherits it
    child = None
    if "spawn_child" in faults:
        child = subprocess.Popen(["sleep", "3600"], stdin=subprocess.DEVNULL)
        say(f"spawned child {child.pid} (fault spawn_child)")
    if "escape_child" in faults:
        escaped = subprocess.Popen(["sleep", "3600"], stdin=subprocess.DEVNULL, start_new_session=True)
        say(f"spawned child {escaped.pid} in its own session (fault escape_child)")
    asyncio.run(serve(args, faults, child))
    return 0


if __name__ == "__main__":
    sys.exit(main())
