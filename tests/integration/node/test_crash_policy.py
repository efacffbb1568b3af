"""The crash policy of the daemon's long-lived tasks, in-process (``Daemon.run`` on the test's loop,
the fake vLLM as children, a real registry): a bug in one server's supervisor, or in the admin
API's server, ends neither the daemon nor the other server. The crashed task is counted in
``rolloutd_task_errors_total{task}`` and started again after a delay; a supervisor's server is
stopped first and comes back as a new process; the admin API binds its address again."""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
import pytest

from rolloutd.config import Config
from rolloutd.httpserver import QuietServer
from rolloutd.node.daemon import Daemon
from rolloutd.supervise.supervisor import Supervisor
from rolloutd.wire.states import ServerState
from tests.support.daemon_harness import config
from tests.support.processes import group_pids
from tests.support.waiting import until

pytestmark = [pytest.mark.slow, pytest.mark.parallel, pytest.mark.timeout(120)]  # fake vLLM: beside other such tests
S = ServerState


def serving(daemon: Daemon, name: str) -> bool:
    running = daemon.servers.get(name)
    return running is not None and running.supervisor.state is S.SERVING


def errors(daemon: Daemon, task: str) -> float:
    return daemon.metrics.registry.get_sample_value("rolloutd_task_errors_total", {"task": task}) or 0


class Node:
    """``Daemon.run`` as a task of the test's loop, stopped (and its children checked gone) at the end."""

    def __init__(self, tmp_path, registry_url: str):
        raw = config(tmp_path, registry_url, [{"name": "s0", "model": "fake-model"},
                                              {"name": "s1", "model": "fake-model"}], fake=True)
        self.daemon = Daemon(Config.model_validate(raw))
        self.groups: set[int] = set()

    async def __aenter__(self) -> Node:
        self.run = asyncio.ensure_future(self.daemon.run())
        await until(lambda: serving(self.daemon, "s0") and serving(self.daemon, "s1") or self.run.done(), 60,
                    "both servers SERVING")
        assert not self.run.done(), self.run
        return self

    def pid(self, name: str) -> int:
        pid = self.daemon.servers[name].supervisor.child.pid
        self.groups.add(pid)
        return pid

    async def __aexit__(self, *exc) -> None:
        self.daemon.request_stop()
        try:
            async with asyncio.timeout(60):
                await self.run
        finally:
            for pgid in self.groups:  # a failed test's leftovers
                for pid in group_pids(pgid):
                    os.kill(pid, signal.SIGKILL)


async def test_a_bug_in_a_supervisor_restarts_that_server_alone(tmp_path, registry, monkeypatch):
    bugs = []
    back_off = Supervisor._back_off

    async def buggy(self, error: str) -> None:  # a bug outside one process's life, once
        if self.name == "s0" and not bugs:
            bugs.append(error)
            raise RuntimeError("a bug while backing off")
        await back_off(self, error)
    monkeypatch.setattr(Supervisor, "_back_off", buggy)
    async with Node(tmp_path, registry.url) as node:
        d = node.daemon
        s0, s1 = node.pid("s0"), node.pid("s1")
        sock = d.servers["s0"].supervisor.socket
        async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(sock))) as fake:
            await fake.post("http://localhost/fake/health", json={"ok": False})  # s0 fails its probes
        await until(lambda: bugs, 20, "the bug hit")
        await until(lambda: serving(d, "s0") and node.pid("s0") != s0, 30, "s0 SERVING again, a new process")
        assert not node.run.done()
        assert errors(d, "supervisor") == 1
        assert group_pids(s0) == [], "the crashed supervisor's server outlived it"
        assert (serving(d, "s1"), node.pid("s1")) == (True, s1), "the other server was touched"
        assert d.servers["s0"].supervisor.incarnation == 2


async def test_a_bug_in_the_admin_api_server_binds_it_again(tmp_path, registry, monkeypatch):
    crashes = []
    serve = QuietServer.serve

    async def buggy(self, sockets=None) -> None:  # uvicorn dies once, taking its socket with it
        if not crashes:
            crashes.append(1)
            for sock in sockets or ():
                sock.close()
            raise RuntimeError("a bug in the admin API's server")
        await serve(self, sockets)
    monkeypatch.setattr(QuietServer, "serve", buggy)
    async with Node(tmp_path, registry.url) as node:
        d = node.daemon
        node.pid("s0"), node.pid("s1")
        await until(lambda: d.admin.started, 30, "the admin API serving again")
        async with httpx.AsyncClient() as http:
            r = await http.get(f"http://127.0.0.1:{d.admin.port}/healthz", timeout=10)
        assert r.status_code == 200
        assert crashes and errors(d, "admin") == 1 and not node.run.done()
