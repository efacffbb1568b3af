"""The trainer side: embedded registry, publish(state_dict) with torch, publish_dir over HTTP,
replicas and demand, and the standalone registry and publish commands."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from safetensors import safe_open

from rolloutd.trainer import EmbeddedRegistry, RegistryHTTP
from rolloutd.trainer.handle import PublishState
from rolloutd.trainer.publish import layer_key, save_shards, shard_plan
from rolloutd.trainer.shards import Cancelled
from rolloutd.wire import errors
from tests.conftest import registry_log, run_cli


def torch_state_dict(seed: int) -> dict:
    import torch
    g = torch.Generator().manual_seed(seed)
    sd = {"model.embed_tokens.weight": torch.randn(256, 64, generator=g),
          "lm_head.weight": torch.randn(256, 64, generator=g),
          "model.norm.weight": torch.ones(64)}
    for i in range(12):
        sd[f"model.layers.{i}.self_attn.q_proj.weight"] = torch.randn(64, 64, generator=g)
        sd[f"model.layers.{i}.mlp.down_proj.weight"] = torch.randn(64, 128, generator=g).to(torch.bfloat16)
    return sd


def numpy_state_dict(seed: int) -> dict:
    import numpy as np
    rng = np.random.default_rng(seed)
    sd = {"model.embed_tokens.weight": rng.standard_normal((256, 64), np.float32)}
    for i in range(12):
        sd[f"model.layers.{i}.self_attn.q_proj.weight"] = rng.standard_normal((64, 64), np.float32)
    return sd


def test_layer_order_and_shard_plan():
    names = ["lm_head.weight", "model.layers.10.x", "model.norm.weight", "model.layers.2.x",
             "model.embed_tokens.weight", "model.layers.2.a"]
    assert sorted(names, key=layer_key) == ["model.embed_tokens.weight", "model.layers.2.a",
                                            "model.layers.2.x", "model.layers.10.x",
                                            "lm_head.weight", "model.norm.weight"]
    plan = shard_plan({"model.layers.0.a": 60, "model.layers.1.a": 60, "model.layers.2.a": 200,
                       "model.layers.3.a": 10}, shard_bytes=100)
    assert plan == [["model.layers.0.a"], ["model.layers.1.a"], ["model.layers.2.a"], ["model.layers.3.a"]]


def read_version(url: str, manifest, headers=None) -> dict:
    """Download every file of a version and open it as safetensors (the bytes a node sees)."""
    from safetensors.torch import load
    out = {}
    with httpx.Client(base_url=url, headers=headers or {}) as c:
        for f in manifest.files:
            out.update(load(c.get(f"/v1/versions/{manifest.version}/files/{f.name}").content))
    return out


@pytest.mark.slow  # torch: seconds to import (the fast tier never loads it)
@pytest.mark.parallel
def test_publish_torch_state_dict_round_trips_in_layer_order(registry, tmp_path):
    import torch
    sd = torch_state_dict(1)
    m = registry.publish(1, sd, shard_bytes=40_000, chunk_bytes=4096, metadata={"step": "100"})
    assert len(m.files) > 2 and m.metadata == {"step": "100"}
    got = read_version(registry.url, m)
    assert got.keys() == sd.keys()
    for k in sd:
        assert got[k].dtype == sd[k].dtype and torch.equal(got[k], sd[k]), k
    # shards follow layer order: every layer of shard i comes before every layer of shard i+1
    layers = []
    with httpx.Client(base_url=registry.url) as c:
        for f in m.files:
            (p := tmp_path / f.name).write_bytes(c.get(f"/v1/versions/1/files/{f.name}").content)
            with safe_open(p, "pt") as st:
                layers.append(sorted(layer_key(k)[:2] for k in st.keys()))
    flat = [x for shard in layers for x in shard]
    assert flat == sorted(flat)


@pytest.mark.slow  # torch, as above
@pytest.mark.parallel
@pytest.mark.parametrize("publisher", ["embedded", "http"])
def test_publish_a_state_dict_with_tied_fused_and_strided_tensors(registry, publisher):
    """What ``model.state_dict()`` of a real model holds: one tensor under two names (tied
    embeddings), views into one fused weight, transposed (non-contiguous) and bf16 tensors."""
    import torch
    g = torch.Generator().manual_seed(7)
    embed = torch.randn(256, 64, generator=g)
    fused = torch.randn(192, 64, generator=g)
    sd = {"lm_head.weight": embed, "model.embed_tokens.weight": embed,  # tied, head listed first
          "model.layers.0.self_attn.q_proj.weight": fused[:64], "model.layers.0.self_attn.k_proj.weight": fused[64:128],
          "model.layers.0.self_attn.v_proj.weight": fused[128:],
          "model.layers.0.mlp.down_proj.weight": torch.randn(128, 64, generator=g).t(),  # strided
          "model.layers.0.mlp.up_proj.weight": torch.randn(128, 64, generator=g).to(torch.bfloat16),
          "model.norm.weight": torch.randn(64, generator=g)}
    client = registry if publisher == "embedded" else RegistryHTTP(registry.url, registry.service.token)
    m = client.publish(1, sd, shard_bytes=40_000, chunk_bytes=4096)
    got = read_version(registry.url, m)
    # the tied tensor is written once, under the name Hugging Face's checkpoints use
    assert set(got) == set(sd) - {"lm_head.weight"}
    for k, v in got.items():
        assert v.dtype == sd[k].dtype and torch.equal(v, sd[k]), k
    assert embed.data_ptr() == sd["model.embed_tokens.weight"].data_ptr()  # the caller's tensors untouched


def test_publish_a_gpu_free_numpy_state_dict_and_a_directory(registry, tmp_path):
    import numpy as np
    sd = {"model.layers.0.w": np.arange(1000, dtype=np.float32)}
    registry.publish(1, sd)
    save_shards({"model.layers.0.w": np.ones(10, np.float16)}, tmp_path)
    m = registry.publish_dir(2, tmp_path)
    assert [f.name for f in m.files] == ["model.safetensors"]
    assert registry.latest()["version"] == 2


def test_wait_for_replicas_and_demand(registry):
    registry.publish(1, numpy_state_dict(1))
    registry.publish(2, numpy_state_dict(2))
    registry.demand(2)

    def node():
        with httpx.Client(base_url=registry.url) as c:
            for i in range(3):
                time.sleep(0.05)  # replicas come one by one, while wait_for_replicas polls
                reply = c.put(f"/v1/replicas/n{i}.s0", json={"node": f"n{i}", "server": "s0",
                              "state": "SERVING", "version": 2}).json()
                assert reply["demand"]["min_version"] == 2

    t = threading.Thread(target=node)
    t.start()
    ready = registry.wait_for_replicas(3, min_version=2, timeout_s=10, poll_s=0.05)
    t.join()
    assert sorted(r["replica_id"] for r in ready) == ["n0.s0", "n1.s0", "n2.s0"]
    with pytest.raises(TimeoutError, match="3 of 4 replicas SERVING"):
        registry.wait_for_replicas(4, min_version=2, timeout_s=0.1, poll_s=0.01)
    with pytest.raises(errors.DemandAhead):
        registry.demand(3)


def test_embedded_registry_starts_accepting_and_stops_cleanly():
    reg = EmbeddedRegistry(port=0).start()
    assert httpx.get(reg.url + "/healthz").status_code == 200  # no wait needed after start()
    port = reg.port
    reg.stop()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/healthz")
    assert not [t for t in threading.enumerate() if t.name == f"http-{port}"]


def test_embedded_registry_stops_while_a_long_poll_waits():
    reg = EmbeddedRegistry(port=0).start()
    polling, real, answers = threading.Event(), reg.service.wait_latest, []

    async def wait_latest(*args):  # a spy: the stop must come while the poll waits, not before it
        polling.set()
        return await real(*args)
    reg.service.wait_latest = wait_latest
    t = threading.Thread(target=lambda: answers.append(
        httpx.get(reg.url + "/v1/versions/latest?after=5&wait_s=60", timeout=70).status_code))
    t.start()
    assert polling.wait(10), "the long poll never reached the registry"
    t0 = time.monotonic()
    reg.stop()
    assert time.monotonic() - t0 < 3
    t.join(5)
    assert answers == [200], "the waiting poll was not answered before the stop"


def test_port_in_use_is_a_clear_error():
    with EmbeddedRegistry(port=0) as reg:
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{reg.port}"):
            EmbeddedRegistry(port=reg.port)


# -- standalone: rolloutd registry / rolloutd publish --------------------------------------------

def test_cli_publish_with_a_token(tmp_path, capsys, caplog):
    """The publish command's code in this process, on an embedded registry with a token; through
    real processes (the registry's and the command's) in the next test."""
    from safetensors.numpy import load
    caplog.set_level(logging.DEBUG)
    (tmp_path / "token").write_text("tok-Never-Logged\n")
    ckpt = tmp_path / "ckpt"
    sd = numpy_state_dict(7)
    save_shards(sd, ckpt, shard_bytes=50_000)
    with EmbeddedRegistry(port=0, token_file=tmp_path / "token", data_dir=tmp_path / "data") as reg:
        argv = ["publish", "--registry", reg.url, "--token-file", str(tmp_path / "token"), "--chunk-bytes", "4096",
                "--metadata", "step=7"]
        run = run_cli(capsys, *argv, "3", str(ckpt))
        assert run.returncode == 0, run.stderr
        assert "published version 3" in run.stdout and "upload v3:" in run.stderr and "100%" in run.stderr
        again = run_cli(capsys, *argv, "3", str(ckpt))  # idempotent retry
        assert again.returncode == 0, again.stderr
        older = run_cli(capsys, *argv, "2", str(ckpt))
        assert older.returncode == 1 and "version_not_newer" in older.stderr and "Traceback" not in older.stderr
        m = reg.manifest(3)
        assert m.metadata == {"step": "7"}
        headers = {"authorization": "Bearer tok-Never-Logged"}
        got = {}
        with httpx.Client(base_url=reg.url, headers=headers) as c:
            for f in m.files:
                got.update(load(c.get(f"/v1/versions/3/files/{f.name}").content))
        assert got.keys() == sd.keys() and all((got[k] == sd[k]).all() for k in sd)
    assert "Never-Logged" not in caplog.text  # the token never reaches the log


def test_cli_publish_errors_are_one_line_in_process(tmp_path, registry, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    run = run_cli(capsys, "publish", "--registry", registry.url, "1", str(empty))
    assert run.returncode == 1 and "no .safetensors files" in run.stderr and "Traceback" not in run.stderr
    run = run_cli(capsys, "publish", "--registry", "http://127.0.0.1:9", "1", str(empty))
    assert run.returncode == 1 and run.stderr.count("\n") == 1 and "Traceback" not in run.stderr
    run = run_cli(capsys, "registry", "--keep-versions", "1")
    assert run.returncode == 2 and "keep_versions" in run.stderr and "Traceback" not in run.stderr


@pytest.mark.slow  # real processes: a standalone registry and the command, each a new Python
@pytest.mark.parallel
def test_cli_publish_to_a_standalone_registry_with_a_token(standalone, tmp_path):
    import torch
    (tmp_path / "token").write_text("tok-Never-Logged\n")
    url, proc = standalone("--token-file", str(tmp_path / "token"), "--data-dir", str(tmp_path / "data"))
    ckpt = tmp_path / "ckpt"
    sd = torch_state_dict(7)
    save_shards(sd, ckpt, shard_bytes=50_000)
    cmd = [sys.executable, "-m", "rolloutd.cli", "publish", "--registry", url,
           "--token-file", str(tmp_path / "token"), "--chunk-bytes", "4096", "--metadata", "step=7",
           "3", str(ckpt)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "published version 3" in run.stdout and "upload v3:" in run.stderr and "100%" in run.stderr
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=60)  # idempotent retry
    assert again.returncode == 0, again.stderr
    older = subprocess.run(cmd[:-2] + ["2", str(ckpt)], capture_output=True, text=True, timeout=60)
    assert older.returncode == 1 and "version_not_newer" in older.stderr and "Traceback" not in older.stderr
    reg = RegistryHTTP(url, "tok-Never-Logged")
    m = reg.manifest(3)
    assert m.metadata == {"step": "7"}
    got = read_version(url, m, {"authorization": "Bearer tok-Never-Logged"})
    assert all(torch.equal(got[k], sd[k]) for k in sd)
    assert "Never-Logged" not in registry_log(tmp_path)  # the token never reaches the log
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0


@pytest.mark.slow  # real processes
@pytest.mark.parallel
def test_no_descriptor_is_closed_twice_in_a_standalone_registry_life(standalone, tmp_path):
    """The registry's process under strace (every thread): versions uploaded over HTTP, read back
    whole and in ranges from its disk store (sendfile), then SIGTERM; no ``close`` of it may fail
    with EBADF (a descriptor closed twice, as uvloop did with the daemon's pipes)."""
    import torch

    from tests.support.daemon_harness import failed_closes
    url, proc = standalone("--data-dir", str(tmp_path / "data"))
    with failed_closes(proc.pid, tmp_path / "close.trace") as failed:
        reg = RegistryHTTP(url)
        for version in (1, 2, 3):
            sd = torch_state_dict(version)
            reg.publish(version, sd, shard_bytes=50_000, chunk_bytes=4096)
            got = read_version(url, reg.manifest(version))
            assert all(torch.equal(got[k], sd[k]) for k in sd)
            name = reg.manifest(version).files[0].name
            with httpx.Client(base_url=url) as c:
                r = c.get(f"/v1/versions/{version}/files/{name}", headers={"range": "bytes=100-4195"})
            assert r.status_code == 206 and len(r.content) == 4096
        reg.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    assert not failed, "\n".join(failed)


@pytest.mark.slow  # real processes, as above
@pytest.mark.parallel
def test_cli_publish_errors_are_one_line(tmp_path, standalone):
    url, _ = standalone()
    empty = tmp_path / "empty"
    empty.mkdir()
    run = subprocess.run([sys.executable, "-m", "rolloutd.cli", "publish", "--registry", url, "1",
                          str(empty)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "no .safetensors files" in run.stderr and "Traceback" not in run.stderr
    run = subprocess.run([sys.executable, "-m", "rolloutd.cli", "publish", "--registry",
                          "http://127.0.0.1:9", "1", str(empty)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "Traceback" not in run.stderr
    run = subprocess.run([sys.executable, "-m", "rolloutd.cli", "registry", "--keep-versions", "1"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "keep_versions" in run.stderr and "Traceback" not in run.stderr


def test_the_daemon_side_never_imports_torch_or_vllm():
    code = ("import sys, numpy as np\n"
            "from rolloutd.trainer import EmbeddedRegistry\n"
            "from rolloutd.rollout.registry_client import RegistryClient\n"
            "import rolloutd.cli, rolloutd.rollout.puller, rolloutd.rollout.mirror, rolloutd.supervise.plugin_path\n"
            "with EmbeddedRegistry(port=0) as reg:\n"
            "    reg.publish(1, {'model.layers.0.w': np.zeros(4, np.float32)})\n"
            "print('torch' in sys.modules or 'vllm' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_embedded_publish_shows_progress_and_a_failure_leaves_nothing(tmp_path):
    import numpy as np
    with EmbeddedRegistry(port=0, data_dir=tmp_path / "data") as reg:
        seen = []
        sd = {f"model.layers.{i}.w": np.zeros(1000, np.float32) for i in range(4)}
        reg.publish(1, sd, shard_bytes=4000, progress=lambda done, total: seen.append((done, total)))
        assert len(seen) == 4 and seen[-1] == (16000, 16000)
        # a tensor safetensors cannot hold fails before any work
        bad = {"model.layers.0.w": np.zeros(10, np.float32), "model.layers.1.w": np.array([None], object)}
        with pytest.raises(ValueError, match="tensor model.layers.1.w has dtype object, which safetensors "
                                             "cannot hold"):
            reg.publish(2, bad, shard_bytes=10)
        # the first shard is staged, the second cannot be: nothing of the version is left
        staged = []
        real_stage = reg.service.blobs.stage_view

        def stage(version, name, size):
            staged.append(name)
            if len(staged) == 2:
                raise OSError(28, "No space left on device")
            return real_stage(version, name, size)
        reg.service.blobs.stage_view = stage
        with pytest.raises(OSError, match="No space left"):
            reg.publish(2, sd, shard_bytes=4000)
        assert staged == ["model-00001-of-00004.safetensors", "model-00002-of-00004.safetensors"]
        assert not any((tmp_path / "data" / "staging").iterdir())
        assert reg.latest()["version"] == 1


# The client's timeout; the registry's verify below takes twice as long. Each upload's reply waits for
# a real fsync within it too: 0.5 s left too little on a disk busy with the rest of the suite (the
# next test failed so once).
SHORT_TIMEOUT_S = 1.0


def test_a_publish_verified_for_longer_than_the_client_timeout_succeeds_and_a_retry_waits_for_it(
        tmp_path, monkeypatch):
    """A registry whose verify takes twice the client's timeout (a fake_ slow verify): ``publish``
    and ``publish_dir`` wait for it however long it works on it; a second trainer publishing the
    same tensors meanwhile (its upload refused: the version is being published) waits for that
    publish too and gets its manifest, not a 409; one verify per version."""
    with EmbeddedRegistry(port=0) as reg:
        real_verify, real_check_upload = reg.service.blobs.verify_staged, reg.service.check_upload
        verifies, verifying, refused = [], threading.Event(), threading.Event()

        def fake_slow_verify(manifest):
            verifies.append(manifest.version)
            verifying.set()
            if manifest.version == 2:  # the retry below is refused its upload while this verify runs
                assert refused.wait(10)
            time.sleep(2 * SHORT_TIMEOUT_S)
            return real_verify(manifest)

        def check_upload(version):  # sees the refusal, changes nothing
            try:
                real_check_upload(version)
            except errors.VersionConflict:
                refused.set()
                raise
        monkeypatch.setattr(reg.service.blobs, "verify_staged", fake_slow_verify)
        monkeypatch.setattr(reg.service, "check_upload", check_upload)
        client = RegistryHTTP(reg.url, reg.service.token, timeout_s=SHORT_TIMEOUT_S)
        t0 = time.monotonic()
        m1 = client.publish(1, numpy_state_dict(1), chunk_bytes=4096)
        assert time.monotonic() - t0 >= 2 * SHORT_TIMEOUT_S and reg.manifest(1).digest == m1.digest

        verifying.clear()
        sd, first = numpy_state_dict(2), {}
        trainer = threading.Thread(target=lambda: first.update(m=client.publish(2, sd, chunk_bytes=4096)))
        trainer.start()
        assert verifying.wait(10)
        retry = RegistryHTTP(reg.url, reg.service.token, timeout_s=SHORT_TIMEOUT_S)
        m2 = retry.publish(2, sd, chunk_bytes=4096)
        trainer.join(10)
        assert refused.is_set() and first["m"].digest == m2.digest == reg.manifest(2).digest
        assert verifies == [1, 2]

        save_shards(numpy_state_dict(3), tmp_path)
        m3 = client.publish_dir(3, tmp_path, chunk_bytes=4096)
        assert reg.manifest(3).digest == m3.digest and verifies == [1, 2, 3]
        client.close()
        retry.close()


def test_an_upload_whose_fsync_outlasts_the_client_timeout_succeeds(tmp_path, monkeypatch):
    """The registry answers an upload once the file is synced; a slow disk (a fake_ slow sync,
    twice the client's timeout) must not fail the publish: the client waits for the reply as
    long as syncing the file at ``UPLOAD_SYNC_BYTES_PER_S`` would take (set here so that this
    small version counts as a large one on a slow disk: 8 times the client's timeout, so that the
    real fsync after the fake's sleep, seconds on a disk busy with the rest of the suite, still
    fits)."""
    import rolloutd.trainer.publish as publish
    # the client's, for every request of the publish (at 0.5 s, with the reply to an upload waited
    # for 4 times that, the test failed once in five runs of the fast tier)
    timeout_s = 1.0
    with EmbeddedRegistry(port=0) as reg:
        real_upload, synced = reg.service.blobs.upload, []

        def upload(version, name, size):
            up = real_upload(version, name, size)
            real_sync = up.sync

            def fake_slow_sync():
                time.sleep(2 * timeout_s)
                synced.append(name)
                real_sync()
            up.sync = fake_slow_sync
            return up
        monkeypatch.setattr(reg.service.blobs, "upload", upload)
        sd = numpy_state_dict(1)
        size = sum(a.nbytes for a in sd.values())
        monkeypatch.setattr(publish, "UPLOAD_SYNC_BYTES_PER_S", size / (8 * timeout_s))
        client = RegistryHTTP(reg.url, reg.service.token, timeout_s=timeout_s)
        m1 = client.publish(1, sd, chunk_bytes=4096)
        save_shards(numpy_state_dict(2), tmp_path)
        m2 = client.publish_dir(2, tmp_path, chunk_bytes=4096)
        assert synced == ["model.safetensors"] * 2
        assert [reg.manifest(v).digest for v in (1, 2)] == [m1.digest, m2.digest]
        client.close()


def test_an_upload_refused_before_its_body_ends_says_why(registry):
    """Each shard goes to the socket from the tensors' memory; an upload the registry refuses at
    once (the number is taken) while 64 MB of body are still coming is reported with the
    registry's reason (409 version_conflict), not as a broken connection."""
    import numpy as np
    client = RegistryHTTP(registry.url, registry.service.token)
    client.publish(1, {"model.layers.0.w": np.zeros(10, np.float32)})
    with pytest.raises(errors.VersionConflict, match="version 1 is already published"):
        client.publish(1, {"model.layers.0.w": np.ones(16 << 20, np.float32)})
    client.close()


@pytest.mark.parametrize("data_dir", [False, True], ids=["memory", "disk"])
def test_publish_async_returns_a_handle_and_the_step_may_change_the_tensors(tmp_path, data_dir):
    import torch
    sd = torch_state_dict(3)
    original = {k: v.clone() for k, v in sd.items()}
    with EmbeddedRegistry(port=0, data_dir=tmp_path / "data" if data_dir else None) as reg:
        handle = reg.publish_async(1, sd, shard_bytes=40_000, chunk_bytes=4096)
        for t in sd.values():  # the next training step, at once: the snapshot is what gets published
            t.add_(1)
        m = handle.wait(60)
        p = handle.progress
        assert (p.state, p.version, p.bytes_done, p.error) == (PublishState.DONE, 1, p.bytes_total, None)
        assert p.bytes_total == sum(t.numel() * t.element_size() for t in original.values())
        got = read_version(reg.url, m)
        for k in original:
            assert torch.equal(got[k], original[k]), k
        assert handle.cancel() is False  # done: it stays published
        # publishing without a snapshot: the caller leaves the tensors alone until it is done
        m2 = reg.publish_async(2, sd, snapshot=False, shard_bytes=40_000, chunk_bytes=4096).wait(60)
        assert m2.digest != m.digest and reg.latest()["version"] == 2


def test_one_options_object_for_every_publish_call(tmp_path, registry):
    """Every publish call takes one ``PublishOptions``, its fields as keywords, or both (the
    keywords win), in-process and over HTTP alike; a field no call knows is refused before any
    byte is written."""
    from pydantic import ValidationError

    from rolloutd.trainer.options import PublishOptions
    sd = numpy_state_dict(1)
    opts = PublishOptions(chunk_bytes=4096, hash_name="blake3", metadata={"step": "1"})
    with EmbeddedRegistry(port=0) as reg:
        m1 = reg.publish(1, sd, opts, metadata={"step": "2"})
        m2 = reg.publish_async(2, numpy_state_dict(2), opts).wait(60)
        save_shards(numpy_state_dict(3), tmp_path)
        m3 = reg.publish_dir(3, tmp_path, opts)
        assert [(m.chunk_bytes, m.hash, m.metadata) for m in (m1, m2, m3)] == [
            (4096, "blake3", {"step": "2"}), (4096, "blake3", {"step": "1"}), (4096, "blake3", {"step": "1"})]
        with pytest.raises(ValidationError, match="hash_bytes"):
            reg.publish(4, sd, hash_bytes=4096)
        assert [v["version"] for v in reg.versions()] == [1, 2, 3]
    client = RegistryHTTP(registry.url, registry.service.token)
    m = client.publish_dir(1, tmp_path, opts, delta=False)
    assert (m.chunk_bytes, m.hash, registry.manifest(1).delta) == (4096, "blake3", None)
    client.close()


def test_publish_async_runs_in_order_and_a_cancelled_one_leaves_nothing(tmp_path):
    import numpy as np
    sd = {f"model.layers.{i}.w": np.full(1000, i, np.float32) for i in range(4)}
    with EmbeddedRegistry(port=0, data_dir=tmp_path / "data") as reg:
        with reg._turn.mine():  # an earlier publish still running: these wait their turn
            first = reg.publish_async(1, sd, shard_bytes=4000)
            dropped = reg.publish_async(2, sd, shard_bytes=4000)
            third = reg.publish_async(3, sd, shard_bytes=4000)
            assert first.progress.state is PublishState.QUEUED
            dropped.cancel(timeout_s=0)  # asked while queued; it ends when its turn comes
        assert first.wait(60).version == 1 and third.wait(60).version == 3
        with pytest.raises(Cancelled):
            dropped.wait(60)
        assert dropped.progress.state is PublishState.CANCELLED and dropped.progress.bytes_done == 0
        assert [v["version"] for v in reg.versions()] == [1, 3]
        assert not any((tmp_path / "data" / "staging").iterdir())


@pytest.mark.slow  # torch, as above
@pytest.mark.parallel
def test_http_publish_streams_from_the_tensors_and_a_retry_is_a_no_op(registry, monkeypatch):
    """``RegistryHTTP.publish`` sends each shard from the tensors' own memory (no file in
    between: making one fails here), in pieces, with progress; the same tensors again are a
    no-op, other tensors under that number a conflict, and nothing but the registry decides."""
    import numpy as np
    import torch

    import rolloutd.trainer.bucket as bucket
    import rolloutd.trainer.publish as publish
    monkeypatch.setattr(publish, "MappedFile", None)  # a file on the way would raise here
    monkeypatch.setattr(bucket, "tempfile", None)   # (a temporary directory is made there)
    sd = torch_state_dict(3)
    sd["model.layers.0.mlp.gate_proj.weight"] = torch.randn(128, 64).t()       # strided: copied through a block
    sd["model.layers.0.mlp.up_proj.weight"] = np.arange(4096, dtype=np.float32)[::2]  # numpy, strided
    client = RegistryHTTP(registry.url, registry.service.token)
    seen: list[tuple[int, int]] = []
    m = client.publish(4, sd, shard_bytes=60_000, chunk_bytes=4096, progress=lambda d, t: seen.append((d, t)))
    assert len(m.files) > 2
    assert seen[-1] == (m.total_bytes, m.total_bytes) and [d for d, _ in seen] == sorted(d for d, _ in seen)
    got = read_version(registry.url, m)
    assert set(got) == set(sd)
    for k, v in sd.items():
        want = torch.from_numpy(np.ascontiguousarray(v)) if isinstance(v, np.ndarray) else v
        assert torch.equal(got[k], want), k
    assert client.publish(4, sd, shard_bytes=60_000, chunk_bytes=4096).digest == m.digest  # a retry
    assert [v["version"] for v in client.versions()] == [4]
    sd["model.norm.weight"] = sd["model.norm.weight"] + 1
    with pytest.raises(errors.VersionConflict):
        client.publish(4, sd, shard_bytes=60_000, chunk_bytes=4096)
    assert registry.manifest(4).digest == m.digest and registry.service.blobs.staged_sizes(4) == {}
    client.close()


@pytest.mark.slow  # a registry process of its own
@pytest.mark.parallel
def test_a_standalone_registry_holds_more_connections_than_its_soft_open_files_limit(tmp_path):
    """Started with a soft limit of 256 open files (the hard one higher, as systemd and most
    shells leave it), ``rolloutd registry`` still answers 400 nodes on connections all open at
    once: it lifts its soft limit to the hard one (without that, accept() fails with EMFILE)."""
    import asyncio
    import collections
    import json
    import resource

    from tests.conftest import free_port, wait_healthy
    n = 400
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 4 * n:
        pytest.fail(f"this test needs a hard open files limit of {4 * n} (it is {hard})")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(resource.getrlimit(resource.RLIMIT_NOFILE)[0], 2 * n), hard))
    port = free_port()
    with open(tmp_path / "registry.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "rolloutd.cli", "registry", "--port", str(port)],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard)))
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc)

        async def node(i: int, all_open: asyncio.Event, count: list[int]) -> int:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            count[0] += 1
            if count[0] == n:
                all_open.set()
            await all_open.wait()  # every connection open at once before any heartbeat
            body = json.dumps({"node": f"n{i}", "server": "s0", "endpoint": f"http://n{i}:8000",
                               "state": "SERVING", "version": None, "target": None, "incarnation": 1}).encode()
            writer.write(f"PUT /v1/replicas/n{i}.s0 HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         f"content-length: {len(body)}\r\n\r\n".encode() + body)
            line = await asyncio.wait_for(reader.readline(), 30)
            writer.close()
            return int(line.split()[1]) if line else 0  # 0: closed unanswered

        async def fleet() -> list[int]:
            all_open, count = asyncio.Event(), [0]
            return await asyncio.gather(*(node(i, all_open, count) for i in range(n)))

        statuses = asyncio.run(fleet())
        assert statuses == [200] * n, f"answers by status: {collections.Counter(statuses)}"
        with open(f"/proc/{proc.pid}/limits") as f:
            soft_now = next(int(line.split()[3]) for line in f if line.startswith("Max open files"))
        assert soft_now > 256
        assert len(httpx.get(url + "/v1/replicas").json()["replicas"]) == n
    finally:
        proc.kill()
        proc.wait(10)


def test_a_standalone_registry_receives_an_upload_without_a_page_fault_per_page(standalone):
    """Upload bodies pass through buffers the registry process reuses: 64 MiB arrive with well
    under one page fault per 4 KiB page (without ``reuse_freed_memory``: about one per page)."""
    url, proc = standalone()

    def faults() -> int:
        with open(f"/proc/{proc.pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[7])  # minflt
    piece = bytes(range(256)) * 256
    size = 64 << 20
    with httpx.Client(base_url=url, timeout=60) as c:
        c.put("/v1/uploads/1/files/warm.safetensors", content=piece * 64).raise_for_status()
        before = faults()
        c.put("/v1/uploads/1/files/model.safetensors", content=(piece for _ in range(size // len(piece))),
              headers={"content-length": str(size)}).raise_for_status()
    per_page = (faults() - before) / (size / 4096)
    assert per_page < 0.25, f"{per_page:.2f} page faults per page received"


def test_every_publish_path_takes_a_cryptographic_chunk_hash(registry, tmp_path, capsys):
    """Nodes take a version from their peers only with blake3 or sha256 chunk digests: each way
    of publishing must be able to make them, and the registry must hold bytes that match."""
    import hashlib

    import blake3
    new = {"blake3": blake3.blake3, "sha256": hashlib.sha256}

    def check(m, hash_name: str) -> None:  # right after the publish: the registry keeps few versions
        assert m.hash == hash_name
        f = m.files[0]
        r = httpx.get(f"{registry.url}/v1/versions/{m.version}/files/{f.name}")
        assert r.status_code == 200, r.text
        assert [new[hash_name](r.content[i:i + 4096]).hexdigest() for i in range(0, len(r.content), 4096)] == f.chunks
    sd = numpy_state_dict(3)
    http = RegistryHTTP(registry.url, registry.service.token)
    ckpt = tmp_path / "ckpt"
    save_shards(sd, ckpt, shard_bytes=50_000)
    check(registry.publish(1, sd, chunk_bytes=4096, hash_name="blake3"), "blake3")
    check(http.publish(2, sd, chunk_bytes=4096, hash_name="blake3"), "blake3")
    check(registry.publish_async(3, sd, chunk_bytes=4096, hash_name="sha256").wait(60), "sha256")
    check(http.publish_dir(4, ckpt, chunk_bytes=4096, hash_name="blake3"), "blake3")
    check(registry.publish_dir(5, ckpt, chunk_bytes=4096, hash_name="blake3"), "blake3")
    run = run_cli(capsys, "publish", "--registry", registry.url, "--chunk-bytes", "4096", "--hash", "blake3", "6",
                  str(ckpt))
    assert run.returncode == 0, run.stderr
    check(registry.manifest(6), "blake3")
