"""What a heartbeat carries for the fleet view (the server's last error, the node's last pull: its
time, full or delta, base and bytes fetched against the version's size; the versions the node
refused), and a registry from before those fields: the node leaves them out after the first
refusal and its heartbeats go on (a real registry over HTTP, whose heartbeat model lacks the newer
fields)."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from pydantic import ValidationError, create_model

from rolloutd.node.heartbeat import Heartbeater
from rolloutd.rollout.puller import PullProgress, PullState
from rolloutd.rollout.refusals import Refusals
from rolloutd.rollout.registry_client import RegistryClient
from rolloutd.rollout.updater import Target
from rolloutd.trainer import EmbeddedRegistry, VersionRefused
from rolloutd.wire.messages import MAX_ERROR_CHARS, OPTIONAL_HEARTBEAT_FIELDS, Heartbeat
from rolloutd.wire.status import LastUpdate, ServerSnapshot

GATE = {"ok": False, "canary": True, "max_abs_dlogprob": 0.5, "tolerance": 0.05, "tokens": 3}


class FakeServer:
    """The supervisor's side a heartbeat reads (a fake: only ``snapshot`` and the failure counter)."""

    name = "gpu0"

    def __init__(self, last_error: str | None, version: int = 2):
        self.last_error, self.version = last_error, version
        self.refusals = Refusals()
        self.metrics = SimpleNamespace(heartbeat_failures=SimpleNamespace(labels=lambda **kw: SimpleNamespace(
            inc=lambda: None)))

    def snapshot(self) -> ServerSnapshot:
        return ServerSnapshot(name=self.name, state="SERVING", pid=None, socket="/run/rolloutd/gpu0.sock",
                              public_port=9001, gpus=[0], endpoint="http://node-a:9001", version=self.version,
                              target=self.version, incarnation=1, restarts=0, state_age_s=1.0,
                              last_error=self.last_error,
                              last_update=LastUpdate(version=self.version, ok=False, at_unix=0.0,
                                                     phases_s={"paused": 0.5}, error=None, gate=GATE))


def heartbeater(url: str, last_error: str | None, version: int = 2) -> tuple[Heartbeater, RegistryClient, list]:
    progress = PullProgress(target=2, clock=iter([10.0, 13.25]).__next__)
    progress.version, progress.state, progress.ended_at = 2, PullState.DONE, progress.clock()
    replies = []
    updater = SimpleNamespace(registry=SimpleNamespace(instance=None), progress=progress,
                              note_reply=replies.append, note_unreachable=lambda why: None)
    cfg = SimpleNamespace(node_name="node-a", heartbeat=SimpleNamespace(interval_s=1.0, timeout_s=5.0))
    client = RegistryClient(url)
    return Heartbeater(FakeServer(last_error, version), lambda: cfg, client, updater), client, replies


async def test_a_heartbeat_carries_the_last_error_clipped_and_the_last_pull():
    with EmbeddedRegistry(port=0) as reg:
        hb, client, _ = heartbeater(reg.url, "x" * 2000)
        try:
            assert await hb.beat()
        finally:
            await client.close()
        rep = reg.service.store.directory()["node-a.gpu0"].heartbeat
    assert len(rep.last_error) == MAX_ERROR_CHARS and rep.last_error.endswith("…")
    assert rep.timings == {"paused": 0.5, "pull": 3.25} and rep.gate.ok is False


async def test_the_last_pull_goes_through_the_registry_to_the_fleet_document_and_stays_while_the_next_runs():
    import httpx

    with EmbeddedRegistry(port=0) as reg:
        hb, client, _ = heartbeater(reg.url, None)
        done = hb._updater.progress
        done.kind, done.base, done.bytes_fetched, done.version_bytes, done.reconstruct_s = (
            "delta", 1, 21_000, 1_000_000, 0.125)
        done.delta_error = None
        try:
            assert await hb.beat()
            hb._updater.progress = PullProgress(target="latest")  # the next pull, still leasing
            assert await hb.beat()
        finally:
            await client.close()
        [node] = httpx.get(reg.url + "/v1/fleet", timeout=10).json()["nodes"]["items"]
    assert node["replicas"][0]["pull"] == {"version": 2, "kind": "delta", "base": 1, "bytes_fetched": 21_000,
                                           "version_bytes": 1_000_000, "seconds": 3.25, "reconstruct_s": 0.125,
                                           "delta_error": None, "fetched_ratio": 0.021}


def test_a_delta_error_is_clipped_like_the_last_error():
    hb, _, _ = heartbeater("http://127.0.0.1:9", None)
    p = hb._updater.progress
    p.kind, p.base, p.bytes_fetched, p.version_bytes, p.reconstruct_s = "full", None, 10, 10, None
    p.delta_error = "y" * 2000
    report = hb.heartbeat().last_pull
    assert len(report.delta_error) == MAX_ERROR_CHARS and report.delta_error.endswith("…")
    assert (report.kind, report.bytes_fetched, report.version_bytes) == ("full", 10, 10)


@pytest.mark.parametrize("bad", [{"delta_error": "x" * (MAX_ERROR_CHARS + 1)}, {"kind": "patch"}, {"base": 0},
                                 {"bytes_fetched": -1}, {"seconds": float("nan")}, {"reconstruct_s": -0.5},
                                 {"saved": 0.9}])
def test_the_registry_refuses_a_last_pull_out_of_bounds(bad):
    ok = {"version": 2, "kind": "delta", "base": 1, "bytes_fetched": 1, "version_bytes": 2, "seconds": 0.1}
    Heartbeat(node="n", server="s", state="SERVING", last_pull=ok)  # what the registry parses a heartbeat with
    with pytest.raises(ValidationError):
        Heartbeat(node="n", server="s", state="SERVING", last_pull={**ok, **bad})


@pytest.mark.parametrize("last_error", ["vllm serve exited with status 1", None])
async def test_a_registry_from_before_the_fields_gets_heartbeats_without_them(monkeypatch, caplog, last_error):
    old = create_model("Heartbeat", __config__=Heartbeat.model_config, **{
        name: (f.annotation, f) for name, f in Heartbeat.model_fields.items() if name not in OPTIONAL_HEARTBEAT_FIELDS})
    monkeypatch.setattr("rolloutd.registry.service.Heartbeat", old)
    caplog.set_level(logging.WARNING, "rolloutd.rollout.heartbeat")
    with EmbeddedRegistry(port=0) as reg:
        hb, client, replies = heartbeater(reg.url, last_error)
        hb.server.refusals.refuse(Target(3, "ab" * 32, Path("/nowhere"), "i"), "gate: canary mismatch", "gpu0")
        try:
            assert await hb.beat() and await hb.beat()
        finally:
            await client.close()
        assert "node-a.gpu0" in reg.service.store.directory()
    refused = ["gate"] + (["last_error"] if last_error else []) + ["refused", "last_pull"]
    assert [r.getMessage().split(" (")[0] for r in caplog.records if r.name == "rolloutd.rollout.heartbeat"] == \
        [f"heartbeat node-a.gpu0: the registry does not take {' and '.join(refused)}"]
    assert len(replies) == 2 and hb._refused == set(refused)


async def test_a_refused_version_reaches_the_directory_the_fleet_view_and_wait_for_replicas_fails_fast(tmp_path):
    import numpy as np

    with EmbeddedRegistry(port=0) as reg:
        for v in (1, 2):
            reg.publish(v, {"w": np.full(64, v, np.float32)})
        bad = reg.manifest(2)
        hb, client, _ = heartbeater(reg.url, None, version=1)
        hb.server.refusals.refuse(Target(2, bad.digest, tmp_path, "i"), "gate: canary mismatch", "gpu0")
        try:
            assert await hb.beat()
        finally:
            await client.close()
        listed = reg.replicas()[0]
        t0 = time.monotonic()
        with pytest.raises(VersionRefused) as refused:
            await asyncio.to_thread(reg.wait_for_replicas, 1, min_version=2, timeout_s=60, poll_s=0.05)
        waited = time.monotonic() - t0
    assert listed["refused"] == [{"version": 2, "digest": bad.digest, "reason": "gate: canary mismatch"}]
    assert refused.value.version == 2 and refused.value.replicas == 1
    assert "their nodes refused version 2 (1 x gate: canary mismatch)" in str(refused.value)
    assert waited < 5, "not wait_for_replicas' timeout"


class fake_registry:
    """A registry that refuses heartbeats with a given 422 body while ``refusing(body)`` says so,
    and answers the rest: for refusals whose words a real registry does not write."""

    def __init__(self, error: dict, refusing=lambda body: True):
        self.error, self.refusing, self.bodies = error, refusing, []

    async def __aenter__(self) -> str:
        from aiohttp import web

        async def put(request):
            body = await request.json()
            self.bodies.append(body)
            if self.refusing(body):
                return web.json_response({"error": self.error}, status=422)
            return web.json_response({"instance": "i", "latest": 2, "demand": {"min_version": None}})

        app = web.Application()
        app.router.add_put("/v1/replicas/{replica}", put)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc) -> None:
        await self._runner.cleanup()


async def beat_through(registry: fake_registry) -> tuple[bool, Heartbeater]:
    async with registry as url:
        hb, client, _ = heartbeater(url, "vllm serve exited with status 1")
        try:
            return await hb.beat(), hb
        finally:
            await client.close()


async def test_a_refused_field_is_told_by_the_error_s_fields_whatever_its_words():
    registry = fake_registry({"code": "invalid_request", "message": "unknown members in this schema",
                              "fields": ["last_error", "last_pull"]},
                             refusing=lambda body: "last_error" in body or "last_pull" in body)
    ok, hb = await beat_through(registry)
    assert ok and hb._refused == {"last_error", "last_pull"}
    assert "gate" in registry.bodies[-1] and "last_pull" not in registry.bodies[-1]


async def test_an_error_whose_words_name_an_optional_field_refuses_nothing_the_registry_did_not_name():
    registry = fake_registry({"code": "invalid_request", "fields": ["state"],
                              "message": "state: not one of the gate, refused or last_pull states; last_error"})
    ok, hb = await beat_through(registry)
    assert not ok and hb._refused == set() and len(registry.bodies) == 1


async def test_a_registry_from_before_error_fields_is_read_by_the_locations_its_message_gives():
    registry = fake_registry({"code": "invalid_request", "message": "gate: Extra inputs are not permitted; "
                              "last_pull.kind: Extra inputs are not permitted"},
                             refusing=lambda body: "gate" in body or "last_pull" in body)
    ok, hb = await beat_through(registry)
    assert ok and hb._refused == {"gate", "last_pull"}
    old = fake_registry({"code": "invalid_request", "message": "state: Input should be 'gate' or 'refused'"})
    ok, hb = await beat_through(old)
    assert not ok and hb._refused == set()


def test_the_registry_names_the_fields_it_refuses_in_the_error_not_only_in_its_words():
    import httpx

    hb = Heartbeat(node="n", server="s", state="SERVING").model_dump(mode="json")
    with EmbeddedRegistry(port=0) as reg:
        r = httpx.put(reg.url + "/v1/replicas/n.s", json={**hb, "state": "", "bogus": 1}, timeout=10)
    assert r.status_code == 422 and r.json()["error"]["fields"] == ["state", "bogus"]


@pytest.mark.slow  # a daemon on the fake vLLM: about 5 s
@pytest.mark.parallel
def test_a_server_serving_a_new_version_is_told_to_the_registry_at_once_not_at_the_next_beat(daemons, registry):
    """With beats 60 s apart, the registry still hears of SERVING on version 2 within a second
    of the daemon: the change of state is beaten at once."""
    from rolloutd.demo import tinymodel

    registry.publish(1, tinymodel.state_dict(tinymodel.TINY, 1), shard_bytes=600_000, chunk_bytes=1 << 16)
    d = daemons(heartbeat={"interval_s": 60, "timeout_s": 2})
    d.wait_versions({"s0": 1}, 30)

    def registry_says(version: int) -> bool:
        return [(r["state"], r["version"]) for r in registry.replicas()] == [("SERVING", version)]

    deadline = time.monotonic() + 5
    while not registry_says(1):  # its first beat may have said STARTING
        assert time.monotonic() < deadline, registry.replicas()
        time.sleep(0.05)
    registry.publish(2, tinymodel.state_dict(tinymodel.TINY, 2), shard_bytes=600_000, chunk_bytes=1 << 16)
    d.wait_versions({"s0": 2}, 30)
    served = time.monotonic()
    while not registry_says(2):
        assert time.monotonic() - served < 1.0, registry.replicas()
        time.sleep(0.02)
