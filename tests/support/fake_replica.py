"""A fake generation server (it is not vLLM: it loads no model), for what a real server cannot be
made to show on cue: a 503 with ``Retry-After``, a gateway's ``409 version_behind``, a
connection closed mid-request, an answer cut short by an abort-mode update, a malformed answer.

It answers ``POST /inference/v1/generate`` the way vLLM's token-in/token-out route does:
``choices[0]`` with ``token_ids`` (``max_tokens`` of them: each the previous one plus one, from
the last prompt token, modulo 1000), ``logprobs.content`` (the sampled token's and, with
``logprobs: k``, the top ``k``), ``finish_reason`` and ``weight_versions`` (one span labelled
``label``); and ``GET /v1/models`` with ``max_model_len``. It records every request (body and
headers). ``script`` is a list of what the next requests get, one item each, then ``ok``:
``ok``, ``503`` (with ``Retry-After: retry_after``), ``409`` (a gateway's ``version_behind``,
holding ``label``), ``500``, ``400``, ``401``, ``drop`` (the connection closed without an
answer), ``bad`` (not JSON), ``abort:K`` (K tokens, then ``finish_reason: "abort"``;
``abort:K>L``: and from then on it serves the label ``L``), ``hang`` (never answers;
``cancelled`` is set when the client leaves). ``delay_s`` delays every answer.
"""

from __future__ import annotations

import asyncio
import threading

from aiohttp import web

from tests.conftest import free_port
from tests.support.gateway_harness import socket_path
from tests.support.loop_thread import LoopThread, serve


class FakeReplica:
    def __init__(self, label: str = "1", *, max_model_len: int = 256, delay_s: float = 0.0):
        self.label, self.max_model_len, self.delay_s = label, max_model_len, delay_s
        self.script: list[str] = []
        self.retry_after = "1"
        self.requests: list[dict] = []  # {"body", "headers"} of each generate request
        self.in_flight = 0
        self.most_in_flight = 0
        self.cancelled = threading.Event()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.socket = socket_path()  # where a gateway in front of it connects, as to a vLLM child
        self._thread = LoopThread(f"fake-replica-{self.port}")
        self._runner: web.BaseRunner | None = None

    # -- life ------------------------------------------------------------------------------------
    def start(self) -> FakeReplica:
        app = web.Application()
        app.add_routes([web.post("/inference/v1/generate", self.generate), web.get("/v1/models", self.models)])
        self._runner, _ = self._thread.start().call(serve(
            app, port=self.port, unix=self.socket, handle_signals=False, handler_cancellation=True, shutdown_timeout=1))
        return self

    def stop(self) -> None:
        self._thread.call(self._runner.cleanup())
        self._thread.stop()

    # -- routes ----------------------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake", "max_model_len": self.max_model_len}]})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append({"body": body, "headers": dict(request.headers)})
        step = self.script.pop(0) if self.script else "ok"
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            return await self._answer(request, body, step)
        finally:
            self.in_flight -= 1

    async def _answer(self, request: web.Request, body: dict, step: str) -> web.StreamResponse:
        if step == "503":
            return _error(503, "unavailable", "paused", {"Retry-After": self.retry_after})
        if step == "409":
            return _error(409, "version_behind", f"holds {self.label}",
                          {"Retry-After": "1", "X-Rolloutd-Version": self.label})
        if step in ("500", "400", "401"):
            return _error(int(step), "fake", f"scripted {step}")
        if step == "drop":
            request.transport.close()
            await asyncio.sleep(1)
            return web.Response()
        if step == "bad":
            return web.Response(text="<html>not json</html>", content_type="text/html")
        if step == "hang":
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        params = body["sampling_params"]
        n = int(params["max_tokens"])
        reason = "length"
        then = None
        if step.startswith("abort:"):
            count, _, then = step.removeprefix("abort:").partition(">")
            n, reason = min(n, int(count)), "abort"
        answer = web.json_response({"choices": [self.choice(body["token_ids"], n, params.get("logprobs"), reason)]})
        if then:
            self.label = then  # it loads that version once it aborted the request
        return answer

    def choice(self, prompt: list[int], n: int, logprobs: int | None, reason: str) -> dict:
        tokens = [(prompt[-1] + 1 + i) % 1000 for i in range(n)]
        choice = {"index": 0, "token_ids": tokens, "finish_reason": reason,
                  "weight_versions": [{"version": self.label, "start": 0, "end": n}] if n else []}
        if logprobs is not None:  # as vLLM lists them: the sampled token (here never among the top
            # ones) first, then the likeliest, the whole list cut at max(logprobs, 1) entries
            def top(t: int) -> list[dict]:
                entries = [{"token_id": t, "logprob": -9.0, "rank": 100}]
                entries += [{"token_id": 900 + r, "logprob": -0.25 * r, "rank": r} for r in range(1, logprobs + 1)]
                return entries[:max(logprobs, 1)]
            choice["logprobs"] = {"content": [{"token_id": t, "logprob": -9.0, "rank": 100, "top_logprobs": top(t)}
                                              for t in tokens]}
        return choice

    # -- as a daemon would list it -------------------------------------------------------------
    def heartbeat(self, version: int | None, state: str = "SERVING", incarnation: int = 1) -> dict:
        return {"node": "fake-node", "server": f"s{self.port}", "endpoint": self.url, "state": state,
                "version": version, "incarnation": incarnation}


def _error(status: int, code: str, message: str, headers: dict | None = None) -> web.Response:
    return web.json_response({"error": {"code": code, "message": message}}, status=status, headers=headers)
