"""The short run of bench/egress.py: a few nodes, each its own host (network namespaces), the
trainer's link shaped with tc, the fake vLLM. Nodes pulling one version together take about
one copy from the trainer, all of them in about the time one takes alone, every mirror
byte-identical to the published files; with the version in a real S3 server the registry
sends none of its bytes; with a fake peer serving bad bytes, a node killed and the registry
restarted mid-pull, every surviving node still ends with the version, byte for byte; and a
delta version (bf16 tensors, 1.5 % of the elements one step away) is rebuilt by every node
from one copy of its delta files out of the registry."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.support.netns_fleet import Fleet

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import egress  # noqa: E402

pytestmark = [pytest.mark.timeout(900)]

MiB = 1 << 20
SIZE_MIB, NODES = 48, 3


@pytest.fixture(scope="module")
def version(tmp_path_factory):
    d = tmp_path_factory.mktemp("version")
    return d, egress.make_version(d, SIZE_MIB, 3)


@pytest.fixture
def fleet(tmp_path):
    if os.geteuid() != 0:
        pytest.fail("the many-nodes harness needs root (network namespaces, tc)")
    with Fleet(tmp_path / "fleet", NODES, rate_mbit=100).setup(store=True) as f:
        yield f


def test_the_trainer_sends_one_copy_and_the_fleet_takes_about_the_time_of_one(fleet, version):
    data, sums = version
    size = SIZE_MIB * MiB
    alone = egress.run_once(fleet, data, sums, size, nodes=1, peers=True, chunk=2 * MiB)
    swarm = egress.run_once(fleet, data, sums, size, nodes=NODES, peers=True, chunk=2 * MiB)
    assert alone["not_identical"] == swarm["not_identical"] == []
    assert alone["trainer_tx_ratio"] >= 1.0  # the measure counts what it should
    assert swarm["registry_file_ratio"] <= 1.5 and swarm["trainer_tx_ratio"] <= 1.5, swarm
    assert swarm["bytes_from_peers_ratio"] >= NODES - 1 - 0.5, swarm
    assert swarm["seconds"] <= 2 * alone["seconds"] + 2.0, (alone, swarm)  # + slack for a loaded machine


def test_from_an_object_store_the_registry_sends_no_version_bytes(fleet, version):
    data, sums = version
    fleet.start_s3()
    out = egress.run_once(fleet, data, sums, SIZE_MIB * MiB, nodes=NODES, peers=True, chunk=2 * MiB,
                          to=f"s3://{fleet.s3.bucket}/ci")
    assert out["not_identical"] == []
    assert out["registry_file_ratio"] == 0
    assert out["trainer_tx_ratio"] < 0.05, out  # heartbeats, announcements, manifests: not the bytes
    assert out["store_tx_ratio"] <= 1.5, out


def test_bad_peer_killed_node_and_restarted_registry_still_end_complete(fleet, version):
    data, sums = version
    out = egress.run_faults(fleet, data, sums, SIZE_MIB * MiB, nodes=NODES, chunk=2 * MiB)
    assert out["not_identical"] == [], out
    assert out["survivors"] == NODES - 1


def test_a_delta_version_leaves_the_registry_once_and_every_node_rebuilds_it(tmp_path):
    if os.geteuid() != 0:
        pytest.fail("the many-nodes harness needs root (network namespaces, tc)")
    sums = egress.make_bf16_versions(tmp_path / "v1", tmp_path / "v2", SIZE_MIB, 3, 0.015)
    with Fleet(tmp_path / "fleet", NODES, rate_mbit=100).setup() as fleet:
        out = egress.run_delta(fleet, tmp_path / "v1", tmp_path / "v2", sums, SIZE_MIB * MiB, nodes=NODES,
                               chunk=256 << 10)
    v1, v2 = out["v1"], out["v2"]
    assert v1["not_identical"] == v2["not_identical"] == [], out
    assert v2["kinds"] == ["delta"] and v2["bytes_fetched_per_node"] == [v2["delta_bytes"]] * NODES, out
    assert v2["delta_of_full"] < 0.05, out  # a small step: a small delta
    # Every delta byte a node fetched came from the registry or a peer, as /status pull_sources says,
    # and the registry sent about one copy: a node that committed first goes on serving its delta
    # files (until it commits another version), however fast its rebuild ended.
    copies = v2["registry_file_per_delta"] + v2["bytes_from_peers"] / v2["delta_bytes"]
    assert abs(copies - NODES) < 0.01, out
    assert v2["registry_file_per_delta"] <= 1.5, out  # NODES copies if peers did not carry the delta files
    assert v2["bytes_from_peers"] >= (NODES - 1.5) * v2["delta_bytes"], out  # as /status pull_sources says
    # Every packet of the trainer's link: the delta's bytes once, and the manifests, long polls and
    # announcements of a few seconds, which weigh on a delta of half a MiB (not on a real one).
    assert v2["trainer_tx_per_delta"] < NODES - 0.5, out
