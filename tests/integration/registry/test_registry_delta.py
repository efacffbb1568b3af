"""Delta versions on the registry: encoded at publish against the newest live version, stored and
served beside the target's files, anchors, every publish path's ``delta=False``, retention."""

from __future__ import annotations

import hashlib
import logging
import re
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest

from rolloutd.registry import deltas
from rolloutd.trainer import EmbeddedRegistry
from rolloutd.trainer.publish import RegistryHTTP
from rolloutd.trainer.shards import save_shards, serialize_shards
from rolloutd.wire.delta import apply_and_verify
from rolloutd.wire.manifest import Manifest, build_manifest
from tests.conftest import run_cli
from tests.support.daemon_harness import wait_until
from tests.support.np_weights import step
from tests.support.tls import CONTEXT as TLS

CHUNK = 4096
SHARD = 150_000  # a few files per version: a tensor may move to another file between versions


def weights(seed: int = 0, n: int = 6, shape=(96, 128)) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"model.layers.{i}.mlp.weight": rng.standard_normal(shape).astype(np.float32) for i in range(n)}





def served(http: httpx.Client, version: int) -> Manifest:
    r = http.get(f"/v1/versions/{version}")
    assert r.status_code == 200, r.text
    return Manifest.model_validate(r.json())


def rebuilt(http: httpx.Client, manifest: Manifest, tmp: Path) -> dict[str, bytes]:
    """The digests of the target files of a delta version, rebuilt from its base's files and its delta files,
    all read over HTTP as a node reads them; every chunk checked against the target digests."""
    delta = manifest.delta
    base = served(http, delta.base_version)
    assert base.digest == delta.base_digest
    (tmp / "base").mkdir(parents=True)
    (tmp / "out").mkdir()
    base_files = {}
    for f in base.files:
        base_files[f.name] = tmp / "base" / f.name
        base_files[f.name].write_bytes(http.get(f"/v1/versions/{base.version}/files/{f.name}").content)
    out = {}
    for d in delta.files:
        path = tmp / d.name
        path.write_bytes(http.get(f"/v1/versions/{manifest.version}/files/{d.name}").content)
        target = manifest.file(d.target)
        dest = tmp / "out" / d.target
        dest.touch()
        apply_and_verify(base_files, path, dest, hash_name=manifest.hash, chunk_bytes=manifest.chunk_bytes,
                         digests=target.chunks)
        out[d.target] = sha(dest.read_bytes())
    return out


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def published(sd: dict) -> dict[str, str]:
    """The digest of each file of ``sd`` as published, its bytes made here independently."""
    return {name: sha(data) for name, data in serialize_shards(sd, SHARD)}


@pytest.fixture(params=["memory", "disk"])
def where(request, tmp_path) -> dict:
    return {"data_dir": tmp_path / "registry"} if request.param == "disk" else {}


@pytest.fixture
def reg(where):
    with EmbeddedRegistry(port=0, **where) as reg:
        yield reg


@pytest.fixture
def http(reg):
    with httpx.Client(base_url=reg.url, timeout=30, verify=TLS) as client:
        yield client


def publish(reg, version: int, sd: dict, **kw) -> Manifest:
    return reg.publish(version, sd, chunk_bytes=CHUNK, shard_bytes=SHARD, **kw)


# -- encode and serve ---------------------------------------------------------------------------

def test_a_small_change_is_published_as_a_delta_that_rebuilds_the_target_exactly(reg, http, tmp_path):
    v1 = weights()
    v2 = step(v1, seed=1)
    publish(reg, 1, v1)
    m2 = publish(reg, 2, v2)
    got = served(http, 2)
    assert got.digest == m2.digest  # the target's digest, as a full publish of these tensors has
    assert got.target() == m2
    assert got.delta is not None and got.delta.base_version == 1
    assert got.delta.base_digest == served(http, 1).digest
    assert len(m2.files) > 1 and {d.target for d in got.delta.files} == {f.name for f in m2.files}
    assert got.delta.total_bytes < 0.2 * got.total_bytes  # 1 % of the elements changed
    assert rebuilt(http, got, tmp_path) == published(v2)
    assert reg.versions()[1]["delta"] == {"base_version": 1, "bytes": got.delta.total_bytes}


def test_removed_new_and_reshaped_tensors_travel_as_they_should(tmp_path):
    v1 = weights(n=4)
    v2 = step(v1, seed=2)
    del v2["model.layers.0.mlp.weight"]                                   # removed
    v2["model.layers.9.mlp.weight"] = np.ones((32, 32), np.float32)       # new
    v2["model.layers.1.mlp.weight"] = v2["model.layers.1.mlp.weight"][:48]  # reshaped: travels whole
    v2["model.layers.2.mlp.weight"] = v2["model.layers.2.mlp.weight"].astype(np.float16)  # dtype changed
    with EmbeddedRegistry(port=0) as reg, httpx.Client(base_url=reg.url) as http:
        publish(reg, 1, v1)
        publish(reg, 2, v2)
        got = served(http, 2)
        assert got.delta is not None
        assert got.delta.removed == ["model.layers.0.mlp.weight"]
        assert rebuilt(http, got, tmp_path) == published(v2)


def test_a_delta_file_is_served_like_any_file_with_ranges(reg, http, where):
    publish(reg, 1, weights())
    publish(reg, 2, step(weights(), seed=3))
    d = served(http, 2).delta.files[0]
    whole = http.get(f"/v1/versions/2/files/{d.name}")
    assert whole.status_code == 200 and len(whole.content) == d.size
    r = http.get(f"/v1/versions/2/files/{d.name}", headers={"range": "bytes=5-20"})
    assert r.status_code == 206 and r.content == whole.content[5:21]
    assert r.headers["content-range"] == f"bytes 5-20/{d.size}"
    r = http.get(f"/v1/versions/2/files/{d.name}", headers={"range": "bytes=-7"})
    assert r.status_code == 206 and r.content == whole.content[-7:]
    r = http.head(f"/v1/versions/2/files/{d.name}")
    assert r.status_code == 200 and int(r.headers["content-length"]) == d.size
    assert http.get(f"/v1/versions/1/files/{d.name}").json()["error"]["code"] == "file_unknown"
    if where:  # a disk store's delta file is sent by the kernel, as the target's files are
        sent = [line for line in http.get("/metrics").text.splitlines()
                if line.startswith("rolloutd_registry_sendfile_responses_total")]
        assert float(sent[0].split()[1]) >= 3


def test_the_encode_runs_off_the_event_loop(monkeypatch):
    """While a delta is encoded the registry answers other requests: the encoder holds no loop."""
    release, entered, threads = threading.Event(), threading.Event(), []
    real = deltas.encode_file

    def fake_slow_encode(*args, **kw):
        threads.append(threading.current_thread().name)
        entered.set()
        assert release.wait(20)
        return real(*args, **kw)
    monkeypatch.setattr(deltas, "encode_file", fake_slow_encode)
    with EmbeddedRegistry(port=0) as reg, httpx.Client(base_url=reg.url, timeout=5) as http:
        publish(reg, 1, weights())
        result = {}
        t = threading.Thread(target=lambda: result.update(m=publish(reg, 2, step(weights(), seed=4))))
        t.start()
        assert entered.wait(20)
        assert http.get("/healthz").status_code == 200  # the loop is free while the encoder works
        assert http.get("/v1/versions/latest").json()["version"] == 1  # not visible before its delta is done
        # the publish fence holds while it encodes: its files are final
        assert http.delete("/v1/uploads/2").json()["error"]["code"] == "version_conflict"
        assert http.put("/v1/uploads/2/files/x.safetensors", content=b"x").json()["error"]["code"] == "version_conflict"
        release.set()
        t.join(20)
        assert served(http, 2).delta is not None
    assert threads and not any(name.startswith("registry-http") or name == "MainThread" for name in threads)


def test_a_failed_encode_publishes_a_full_version(monkeypatch, caplog):
    def fake_broken_encode(*args, **kw):
        raise MemoryError("fake: no memory for the delta")
    monkeypatch.setattr(deltas, "encode_file", fake_broken_encode)
    caplog.set_level(logging.INFO, "rolloutd.registry")
    with EmbeddedRegistry(port=0) as reg, httpx.Client(base_url=reg.url) as http:
        publish(reg, 1, weights())
        m2 = publish(reg, 2, step(weights(), seed=5))
        assert served(http, 2) == m2
        assert http.get("/v1/versions/2/files/" + m2.files[0].name).status_code == 200
    assert "publish version 2 as a full version (its delta could not be encoded: MemoryError)" in caplog.text


# -- when a version goes full ---------------------------------------------------------------------

def test_delta_false_publishes_a_full_version_on_every_path(tmp_path):
    v = {1: weights()}
    for n in range(2, 12):
        v[n] = step(v[n - 1], seed=n)
    d = tmp_path / "dirs"
    dirs = {n: save_shards(v[n], d / str(n), SHARD)[0].parent for n in v}
    with EmbeddedRegistry(port=0, delta_anchor_every=100) as reg, httpx.Client(base_url=reg.url) as http:
        client = RegistryHTTP(reg.url)
        publish(reg, 1, v[1])
        calls = [
            lambda n, **kw: publish(reg, n, v[n], **kw),
            lambda n, **kw: reg.publish_async(n, v[n], chunk_bytes=CHUNK, shard_bytes=SHARD, **kw).wait(30),
            lambda n, **kw: reg.publish_dir(n, dirs[n], chunk_bytes=CHUNK, **kw),
            lambda n, **kw: client.publish(n, v[n], chunk_bytes=CHUNK, shard_bytes=SHARD, **kw),
            lambda n, **kw: client.publish_dir(n, dirs[n], chunk_bytes=CHUNK, **kw),
        ]
        n = 2
        for call in calls:
            call(n, delta=False)
            assert served(http, n).delta is None, n
            call(n + 1)  # the same path, by default: a delta
            assert served(http, n + 1).delta.base_version == n, n + 1
            n += 2
        client.close()


def test_a_registry_with_deltas_off_publishes_full_versions():
    with EmbeddedRegistry(port=0, delta=False) as reg, httpx.Client(base_url=reg.url) as http:
        publish(reg, 1, weights())
        publish(reg, 2, step(weights(), seed=6))
        assert served(http, 2).delta is None


def test_a_full_anchor_every_nth_version(caplog):
    caplog.set_level(logging.INFO, "rolloutd.registry")
    sd = weights()
    with EmbeddedRegistry(port=0, delta_anchor_every=3, keep_versions=10) as reg, \
            httpx.Client(base_url=reg.url) as http:
        for n in range(1, 8):
            sd = step(sd, seed=n)
            publish(reg, n, sd)
        kinds = {n: served(http, n).delta and served(http, n).delta.base_version for n in range(1, 8)}
    assert kinds == {1: None, 2: 1, 3: 2, 4: None, 5: 4, 6: 5, 7: None}
    assert "publish version 4 as a full version (an anchor: every 3 versions)" in caplog.text


def bytes_weights(seed: int, n: int = 10) -> dict[str, np.ndarray]:
    """Ten tensors of random bytes: a changed one costs its whole size in a delta (no pattern)."""
    rng = np.random.default_rng(seed)
    return {f"t.{i}": rng.integers(0, 256, 20_000, dtype=np.uint8) for i in range(n)}


def test_a_full_version_when_the_deltas_since_the_last_pass_the_fraction_or_one_is_not_worth_it(caplog):
    caplog.set_level(logging.INFO, "rolloutd.registry")
    sd = bytes_weights(0)
    fresh = bytes_weights(1)
    changes = {2: ["t.0"], 3: ["t.1"], 4: ["t.2"], 5: ["t.3", "t.4", "t.5"], 6: ["t.6"]}
    with EmbeddedRegistry(port=0, delta_anchor_fraction=0.25, keep_versions=10) as reg, \
            httpx.Client(base_url=reg.url) as http:
        publish(reg, 1, sd)
        for n, names in changes.items():
            sd = {**sd, **{k: (fresh[k] + n).astype(np.uint8) for k in names}}
            publish(reg, n, sd)
        got = {n: served(http, n) for n in range(1, 7)}
    ratio = {n: m.delta and m.delta.total_bytes / m.total_bytes for n, m in got.items()}
    assert ratio[2] is not None and 0.1 <= ratio[2] < 0.12  # one tensor of ten: about a tenth
    assert ratio[3] is not None                           # two since the last full: 20 % < 25 %
    assert ratio[4] is None                               # three would pass 25 %: an anchor
    assert ratio[5] is None                               # 30 % in one delta: not worth it
    assert got[6].delta.base_version == 5                 # and deltas again after it
    assert "publish version 4 as a full version (an anchor: the delta bytes since the last full" in caplog.text
    assert "publish version 5 as a full version (not worth it: the delta would be" in caplog.text


def test_versions_whose_bytes_are_in_an_object_store_stay_full(caplog):
    """A manifest-only version (its files in S3): nothing here to encode it against, or from."""
    caplog.set_level(logging.INFO, "rolloutd.registry")
    with EmbeddedRegistry(port=0) as reg, httpx.Client(base_url=reg.url) as http:
        publish(reg, 1, weights())
        m1 = served(http, 1)
        m2 = m1.model_copy(update={"version": 2, "digest": None, "source": "s3://bucket/run/2"}).sealed()
        r = http.post("/v1/versions", content=m2.model_dump_json())
        assert r.status_code == 201 and r.json()["delta"] is None
        assert served(http, 2).delta is None
        publish(reg, 3, step(weights(), seed=7))  # its base would be version 2: no bytes of it here
        assert served(http, 3).delta is None
    assert "publish version 2 as a full version (its bytes are in an object store)" in caplog.text
    assert "publish version 3 as a full version (version 2's bytes are not on this registry)" in caplog.text


# -- what publishing a delta must not change -------------------------------------------------------

def test_republishing_a_delta_version_answers_it_unchanged(reg, http):
    publish(reg, 1, weights())
    v2 = step(weights(), seed=8)
    publish(reg, 2, v2)
    first = served(http, 2)
    assert publish(reg, 2, v2) == first.target()  # the same tensors again: a no-op
    for body in (first, first.target()):  # the manifest with or without its delta section
        r = http.post("/v1/versions", content=body.model_dump_json())
        assert r.status_code == 200 and r.json()["created"] is False
        assert r.json()["delta"] == {"base_version": 1, "bytes": first.delta.total_bytes}
    assert served(http, 2) == first


def test_a_delta_section_sent_by_the_publisher_is_replaced_by_the_registrys(reg, http, tmp_path):
    publish(reg, 1, weights())
    publish(reg, 2, step(weights(), seed=9))
    v3 = step(weights(), seed=10)
    paths = save_shards(v3, tmp_path / "v3", SHARD)
    for p in paths:
        assert http.put(f"/v1/uploads/3/files/{p.name}", content=p.read_bytes()).status_code == 201
    m3 = build_manifest(3, paths, chunk_bytes=CHUNK)
    forged = m3.with_delta(served(http, 2).delta)  # version 2's section: base 1, its own delta files
    r = http.post("/v1/versions", content=forged.model_dump_json())
    assert r.status_code == 201
    got = served(http, 3)
    assert got.digest == m3.digest and got.delta.base_version == 2
    assert rebuilt(http, got, tmp_path / "check") == {p.name: sha(p.read_bytes()) for p in paths}


def test_duplicate_tensors_and_a_canary_that_cannot_pass_are_refused_with_a_base_too(reg, http, tmp_path):
    from rolloutd.wire.manifest import Canary
    publish(reg, 1, weights())
    a = save_shards({"x": np.ones(8, np.float32)}, tmp_path / "a")[0]
    b = (tmp_path / "b.safetensors")
    b.write_bytes(a.read_bytes())
    for p in (a, b):
        assert http.put(f"/v1/uploads/2/files/{p.name}", content=p.read_bytes()).status_code == 201
    r = http.post("/v1/versions", content=build_manifest(2, [a, b], chunk_bytes=CHUNK).model_dump_json())
    assert r.status_code == 422 and r.json()["error"]["code"] == "duplicate_tensor", r.text
    canary = Canary(prompt_ids=[1], continuation_ids=[2], logprobs=[-0.1], tolerance=2.0)  # would pass anything
    paths = save_shards(step(weights(), seed=11), tmp_path / "c", SHARD)
    for p in paths:
        assert http.put(f"/v1/uploads/2/files/{p.name}", content=p.read_bytes()).status_code == 201
    m = build_manifest(2, paths, chunk_bytes=CHUNK, canary=canary)
    r = http.post("/v1/versions", content=m.model_dump_json())
    assert r.status_code == 422 and r.json()["error"]["code"] == "bad_canary", r.text
    assert http.get("/v1/versions/latest").json()["version"] == 1


# -- retention and restarts ------------------------------------------------------------------------

def test_reclaiming_a_version_reclaims_its_delta_files(tmp_path, where):
    with EmbeddedRegistry(port=0, keep_versions=2, **where) as reg, httpx.Client(base_url=reg.url) as http:
        sd = weights()
        publish(reg, 1, sd)
        publish(reg, 2, sd := step(sd, seed=12))
        d = served(http, 2).delta.files[0]
        held = reg.service.store.get(2).blobs
        assert d.name in held
        path = held[d.name].path if where else None
        publish(reg, 3, step(sd, seed=13))
        publish(reg, 4, step(sd, seed=14))  # version 2 is now older than the newest 2: reclaimed
        assert http.get(f"/v1/versions/2/files/{d.name}").json()["error"]["code"] == "version_retired"
        if where:
            wait_until(lambda: not path.exists(), 10, "the delta file of version 2 deleted")
        else:
            wait_until(lambda: not held, 10, "the delta blob of version 2 let go of")


def test_a_disk_registry_restarted_keeps_delta_sections_and_their_files(tmp_path, caplog):
    caplog.set_level(logging.INFO, "rolloutd.registry")
    data = tmp_path / "registry"
    sd = weights()
    with EmbeddedRegistry(port=0, data_dir=data, keep_versions=5) as reg, httpx.Client(base_url=reg.url) as http:
        publish(reg, 1, sd)
        publish(reg, 2, sd := step(sd, seed=15))
        before = served(http, 2)
        delta_bytes = {d.name: http.get(f"/v1/versions/2/files/{d.name}").content for d in before.delta.files}
    with EmbeddedRegistry(port=0, data_dir=data, keep_versions=5) as reg, httpx.Client(base_url=reg.url) as http:
        assert served(http, 2) == before
        for name, data_ in delta_bytes.items():
            assert http.get(f"/v1/versions/2/files/{name}").content == data_
        assert rebuilt(http, before, tmp_path / "check") == published(sd)
        publish(reg, 3, step(sd, seed=16))  # the chain since the last full version is known again
        assert served(http, 3).delta.base_version == 2


def test_a_version_whose_delta_file_is_lost_on_disk_loads_as_a_full_version(tmp_path, caplog):
    data = tmp_path / "registry"
    sd = weights()
    with EmbeddedRegistry(port=0, data_dir=data) as reg, httpx.Client(base_url=reg.url) as http:
        publish(reg, 1, sd)
        m2 = publish(reg, 2, sd := step(sd, seed=19))
        name = served(http, 2).delta.files[0].name
    (data / "versions" / "2" / name).write_bytes(b"cut short")
    with EmbeddedRegistry(port=0, data_dir=data) as reg, httpx.Client(base_url=reg.url) as http:
        assert served(http, 2) == m2  # its target whole: still the version, now a full one
        assert http.get(f"/v1/versions/2/files/{name}").json()["error"]["code"] == "file_unknown"
        assert http.get(f"/v1/versions/2/files/{m2.files[0].name}").status_code == 200
    assert f"load version 2 without its delta section: {name} has 9 bytes" in caplog.text


def test_a_restart_that_lost_the_chain_publishes_a_full_version_next(tmp_path, caplog):
    caplog.set_level(logging.INFO, "rolloutd.registry")
    data = tmp_path / "registry"
    sd = weights()
    with EmbeddedRegistry(port=0, data_dir=data, keep_versions=2) as reg:
        for n in range(1, 4):
            publish(reg, n, sd := step(sd, seed=n))  # version 1 is reclaimed: 2 and 3 are deltas on it and 2
    with EmbeddedRegistry(port=0, data_dir=data, keep_versions=2) as reg, httpx.Client(base_url=reg.url) as http:
        assert served(http, 3).delta.base_version == 2
        publish(reg, 4, step(sd, seed=4))
        assert served(http, 4).delta is None
    assert "publish version 4 as a full version (the chain of deltas before version 3 is unknown here" in caplog.text


# -- metrics, the command line ---------------------------------------------------------------------

def test_metrics_count_delta_versions_and_their_bytes():
    with EmbeddedRegistry(port=0) as reg, httpx.Client(base_url=reg.url) as http:
        publish(reg, 1, weights())
        publish(reg, 2, step(weights(), seed=17))
        m = served(http, 2)
        text = http.get("/metrics").text
    values = {m[1]: float(m[2]) for m in re.finditer(r"^(rolloutd_registry_\w+) (\S+)$", text, re.M)}
    assert values["rolloutd_registry_publishes_total"] == 2
    assert values["rolloutd_registry_delta_publishes_total"] == 1
    assert values["rolloutd_registry_delta_bytes_total"] == m.delta.total_bytes
    assert values["rolloutd_registry_delta_target_bytes_total"] == m.total_bytes
    assert values["rolloutd_registry_delta_encode_seconds_count"] == 1


def test_rolloutd_publish_full(tmp_path, capsys):
    sd = weights()
    dirs = {}
    for n in (1, 2, 3):
        sd = step(sd, seed=n)
        dirs[n] = str(save_shards(sd, tmp_path / str(n), SHARD)[0].parent)
    with EmbeddedRegistry(port=0) as reg, httpx.Client(base_url=reg.url) as http:
        base = ("publish", "--registry", reg.url, "--chunk-bytes", str(CHUNK))
        assert run_cli(capsys, *base, "1", dirs[1]).returncode == 0
        out = run_cli(capsys, *base, "--full", "2", dirs[2])
        assert out.returncode == 0 and " as a delta" not in out.stdout, out.stdout
        assert served(http, 2).delta is None
        out = run_cli(capsys, *base, "3", dirs[3])
        assert out.returncode == 0 and "published version 3 as a delta on version 2 (" in out.stdout, out.stdout
        assert served(http, 3).delta.base_version == 2


def test_rolloutd_registry_takes_no_delta():
    from rolloutd.cli import build_parser
    args = build_parser().parse_args(["registry", "--no-delta", "--delta-anchor-every", "4"])
    assert args.delta is False and args.delta_anchor_every == "4"
    assert "delta" not in vars(build_parser().parse_args(["registry"]))  # the settings' default applies


def test_the_post_reply_and_the_version_list_say_how_a_version_was_published(reg, http, tmp_path):
    publish(reg, 1, weights())
    paths = save_shards(step(weights(), seed=18), tmp_path / "v2", SHARD)
    for p in paths:
        assert http.put(f"/v1/uploads/2/files/{p.name}", content=p.read_bytes()).status_code == 201
    r = http.post("/v1/versions", content=build_manifest(2, paths, chunk_bytes=CHUNK).model_dump_json())
    summary = {"base_version": 1, "bytes": served(http, 2).delta.total_bytes}
    assert r.status_code == 201 and r.json()["delta"] == summary
    assert [v["delta"] for v in http.get("/v1/versions").json()["versions"]] == [None, summary]
