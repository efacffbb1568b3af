"""``rolloutd fleet``: the fleet view as a table and as JSON, from a real registry over HTTP."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rolloutd import cli, fleetctl
from rolloutd.trainer import EmbeddedRegistry
from rolloutd.wire.messages import GateReport, Heartbeat, PullReport
from tests.conftest import free_port
from tests.support.store_versions import manifest

TOKEN = "fleet-cli-token"


@pytest.fixture
def reg(tmp_path, clock):
    (tmp_path / "token").write_text(TOKEN + "\n")
    with EmbeddedRegistry(port=0, token_file=tmp_path / "token", clock=clock) as r:
        yield r


def fleet(tmp_path, reg, *args: str) -> int:
    return cli.main(["fleet", "--registry", reg.url, "--token-file", str(tmp_path / "token"), *args])


def seed(reg, clock) -> None:
    from rolloutd.registry.blobs import MemoryBlob
    store = reg.service.store

    def beat(node, server, state="SERVING", version=None, **kw):
        store.heartbeat(f"{node}.{server}", Heartbeat(node=node, server=server, state=state, version=version, **kw))
    for n in ("node-b", "node-a"):
        for s in ("gpu0", "gpu1"):
            beat(n, s)
    store.publish(manifest(1), {"model.safetensors": MemoryBlob(b"x")})
    clock.advance(4)
    beat("node-a", "gpu0", version=1, timings={"paused": 0.25, "pull": 1.5})
    beat("node-a", "gpu1", "BACKOFF", last_error="vllm serve exited with status 1\n(see its log)")
    beat("node-b", "gpu0", version=1, gate=GateReport(ok=False, canary=True, max_abs_dlogprob=0.2,
                                                      tolerance=0.05, tokens=4))
    clock.advance(2)
    beat("node-b", "gpu1", version=1)


def test_the_table_shows_every_replica_grouped_by_node(tmp_path, reg, clock, capsys):
    seed(reg, clock)
    assert fleet(tmp_path, reg) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith(f"registry {reg.url} (instance {reg.service.store.instance}): newest v1, "
                               "published 6.0s ago; no demand")
    assert lines[1] == "replicas 4 on 2 nodes: 1 backoff, 3 serving; 2 with problems (0 silent over 15 s)"
    assert lines[2] == "on the newest version 3; one behind 0; two 0; three or more 0; start model 1"
    version = next(ln for ln in lines if ln.startswith("v1 "))
    assert version.split() == ["v1", "live", "6.0s", "ago", "1", "B", "0", "3", "3", "3", "4.0s", "6.0s", "6.0s"]
    rows = [ln.split(None, 4) for ln in lines if ln.startswith("node-")]
    assert [r[:3] for r in rows] == [["node-a", "gpu0", "SERVING"], ["node-a", "gpu1", "BACKOFF"],
                                     ["node-b", "gpu0", "SERVING"], ["node-b", "gpu1", "SERVING"]]
    a0 = next(ln for ln in lines if ln.startswith("node-a  gpu0"))
    assert "250ms" in a0 and "1.5s" in a0
    a1 = next(ln for ln in lines if ln.startswith("node-a  gpu1"))
    assert "base" in a1 and "failed" in a1 and "vllm serve exited with status 1 (see its log)" in a1
    assert "gate" in next(ln for ln in lines if ln.startswith("node-b  gpu0"))


def test_the_table_shows_how_the_last_pull_came_and_what_it_fetched(tmp_path, reg, clock, capsys):
    from rolloutd.registry.blobs import MemoryBlob
    store = reg.service.store
    store.publish(manifest(1), {"model.safetensors": MemoryBlob(b"x")})
    pulls = {"delta": PullReport(version=1, kind="delta", base=6, bytes_fetched=21, version_bytes=1000,
                                 seconds=0.5, reconstruct_s=0.25),
             "full": PullReport(version=1, kind="full", bytes_fetched=1000, version_bytes=1000, seconds=2.0),
             "resumed": PullReport(version=1, kind="full", bytes_fetched=400, version_bytes=1000, seconds=1.0),
             "fellback": PullReport(version=1, kind="full", bytes_fetched=1000, version_bytes=1000, seconds=2.0,
                                    delta_error="version 1: delta file m.delta: chunk 0 digest differs"),
             "held": PullReport(version=1, kind="full", bytes_fetched=0, version_bytes=1000, seconds=0.01),
             "tiny": PullReport(version=1, kind="delta", base=6, bytes_fetched=3, version_bytes=10_000,
                                seconds=0.5, reconstruct_s=1.5)}
    for node, pull in pulls.items():
        store.heartbeat(f"{node}.gpu0", Heartbeat(node=node, server="gpu0", state="SERVING", version=1,
                                                  timings={"pull": pull.seconds}, last_pull=pull))
    store.heartbeat("none.gpu0", Heartbeat(node="none", server="gpu0", state="SERVING", version=1))
    assert fleet(tmp_path, reg) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(ln for ln in lines if ln.startswith("NODE "))
    at, rebuild = header.index("FETCHED"), header.index("REBUILD")
    cells = {ln.split()[0]: (ln[at:rebuild].strip(), ln[rebuild:].split()[0]) for ln in lines
             if ln.split() and ln.split()[0] in {*pulls, "none"}}
    assert cells == {"delta": ("delta 2.1% on v6", "250ms"), "full": ("full", "-"), "resumed": ("full 40%", "-"),
                     "fellback": ("full (delta failed)", "-"), "held": ("held", "-"),
                     "tiny": ("delta 0.03% on v6", "1.5s"), "none": ("-", "-")}


def test_filters_and_json(tmp_path, reg, clock, capsys):
    seed(reg, clock)
    assert fleet(tmp_path, reg, "--problems") == 0
    rows = [ln.split()[:2] for ln in capsys.readouterr().out.splitlines() if ln.startswith("node-")]
    assert rows == [["node-a", "gpu1"], ["node-b", "gpu0"]]
    assert fleet(tmp_path, reg, "--json", "--node", "node-b") == 0
    doc = json.loads(capsys.readouterr().out)
    assert [n["node"] for n in doc["nodes"]["items"]] == ["node-b"] and doc["summary"]["replicas"] == 4
    assert fleet(tmp_path, reg, "--state", "NOPE") == 0
    assert "(no replica matches)" in capsys.readouterr().out


def test_json_has_every_page_of_nodes(tmp_path, reg, monkeypatch, capsys):
    for n in range(7):
        reg.service.store.heartbeat(f"n{n}.s0", Heartbeat(node=f"n{n}", server="s0", state="SERVING"))
    monkeypatch.setattr(fleetctl, "PAGE_NODES", 3)
    assert fleet(tmp_path, reg, "--json") == 0
    nodes = json.loads(capsys.readouterr().out)["nodes"]
    assert [n["node"] for n in nodes["items"]] == [f"n{i}" for i in range(7)]
    assert (nodes["total"], nodes["pages"]) == (7, 1)


def test_an_empty_fleet_and_a_wrong_token_and_no_registry(tmp_path, reg, capsys):
    assert fleet(tmp_path, reg) == 0
    out = capsys.readouterr().out
    assert "nothing published" in out and "(no replica has reported)" in out
    (tmp_path / "wrong").write_text("nope")
    assert cli.main(["fleet", "--registry", reg.url, "--token-file", str(tmp_path / "wrong")]) == 1
    assert capsys.readouterr().err.strip() == "rolloutd: unauthorized: missing or wrong bearer token"
    assert cli.main(["fleet", "--registry", f"http://127.0.0.1:{free_port()}", "--timeout-s", "2"]) == 1
    assert capsys.readouterr().err.startswith("rolloutd: unavailable: GET")


def test_the_installed_command_prints_the_table(tmp_path, reg, clock):
    seed(reg, clock)
    run = subprocess.run([sys.executable, "-m", "rolloutd.cli", "fleet", "--registry", reg.url, "--token-file",
                          str(tmp_path / "token")], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert sum(ln.startswith("node-") for ln in run.stdout.splitlines()) == 4
