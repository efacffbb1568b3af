"""The plugin engine on real ``vllm serve`` processes (CPU build), fed by the real puller from a
real registry over HTTP.

Two servers start once for the module, side by side (one core each):
- ``server_a`` starts on weights A; rolloutd is *not* installed in vLLM's environment: the
  plugin comes from the directory the daemon prepares (plugin_path.install_plugin);
- ``server_b`` starts directly on weights B, with rolloutd pip-installed on vLLM's path (the
  other way the plugin loads); its outputs are the reference for B.
Every test first puts the servers in a known state, so the order of tests does not matter.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from rolloutd.demo import tinymodel
from rolloutd.rollout.mirror import Mirror
from rolloutd.rollout.puller import Puller, PullSettings
from rolloutd.rollout.registry_client import RegistryClient
from rolloutd.supervise.plugin_path import install_plugin
from rolloutd.trainer import EmbeddedRegistry
from tests.conftest import free_port
from tests.support.vllm_server import (
    CYCLE,
    ROOT,
    TINY_PROMPTS,
    VllmServer,
    client,
    pip_install_rolloutd,
    plugin_cycle,
    put_on,
    tiny_outputs,
    tiny_tokens,
)

pytestmark = [pytest.mark.timeout(900)]

SEED_A, SEED_B = 0, 1


# -- fixtures ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("models")
    return {"A": tinymodel.build(d / "A", seed=SEED_A), "B": tinymodel.build(d / "B", seed=SEED_B)}


@pytest.fixture(scope="module")
def servers(models, tmp_path_factory):
    d = tmp_path_factory.mktemp("vllm")
    injected = install_plugin(d / "plugin")
    installed = pip_install_rolloutd(d / "site")
    started = [VllmServer(models["A"], free_port(), d / "a.log", pythonpath=[injected], cpus="0"),
               VllmServer(models["B"], free_port(), d / "b.log", pythonpath=[installed], cpus="1")]
    try:
        for s in started:
            s.wait_healthy()
        yield {"a": started[0], "b": started[1]}
    finally:
        for s in started:
            s.stop()


@pytest.fixture(scope="module")
def versions(models, tmp_path_factory):
    """A registry holding version 1 = B and version 2 = A, mirrored on this node by the puller."""
    mirror = Mirror(tmp_path_factory.mktemp("mirror"), max_bytes=1 << 30)
    with EmbeddedRegistry(port=0) as reg:
        reg.publish(1, tinymodel.state_dict(tinymodel.TINY, SEED_B), shard_bytes=600_000, chunk_bytes=1 << 16)
        reg.publish(2, tinymodel.state_dict(tinymodel.TINY, SEED_A), shard_bytes=600_000, chunk_bytes=1 << 16)

        async def pull_all():
            async with RegistryClient(reg.url) as c:
                puller = Puller(c, mirror, PullSettings(holder="test-node", streams=4, request_bytes=1 << 15))
                return {v: await puller.pull(v) for v in (1, 2)}

        pulled = asyncio.run(pull_all())
    assert [len(list(p.path.glob("*.safetensors"))) for p in pulled.values()] == [4, 4]  # several files
    return {v: (p.path, p.digest) for v, p in pulled.items()}


# -- helpers ----------------------------------------------------------------------------------
def weight_version(url: str) -> str:
    with client(url) as c:
        return c.get("/weight_info").json()["weight_version"]


def healthy(url: str) -> bool:
    with client(url) as c:
        return c.get("/health").status_code == 200 and c.get("/is_paused").json() == {"is_paused": False}


# -- the tests --------------------------------------------------------------------------------
def test_update_switches_outputs_and_labels_the_version(servers, versions):
    a, b = servers["a"].url, servers["b"].url
    put_on(b, versions, 1)  # the reference server stays on B
    ref_b = tiny_tokens(b)
    put_on(a, versions, 2)  # A, labelled "2"
    ref_a = tiny_tokens(a)
    assert ref_a != ref_b, "weights A and B must give different greedy outputs"

    steps = plugin_cycle(a, *versions[1], "1")
    assert {s: code for s, (code, _) in steps.items()} == dict.fromkeys(CYCLE, 200), steps
    out = tiny_outputs(a)
    assert [t for t, _ in out] == ref_b
    assert weight_version(a) == "1"
    assert all(spans == [{"version": "1", "start": 0, "end": 16}] for _, spans in out)

    put_on(a, versions, 2)
    assert tiny_tokens(a) == ref_a and weight_version(a) == "2"


def test_the_installed_plugin_updates_too(servers, versions):
    """server_b loads the plugin from rolloutd's pip-installed entry point."""
    b = servers["b"].url
    put_on(b, versions, 2)
    on_a = tiny_tokens(b)
    put_on(b, versions, 1)
    assert tiny_tokens(b) != on_a and weight_version(b) == "1"
    put_on(b, versions, 2)
    assert tiny_tokens(b) == on_a


def _wrong_digest(path: Path, digest: str, tmp: Path) -> tuple[Path, str]:
    return path, "0" * 64


def _missing_file(path: Path, digest: str, tmp: Path) -> tuple[Path, str]:
    bad = shutil.copytree(path, tmp / "1")
    sorted(bad.glob("*.safetensors"))[1].unlink()
    return bad, digest


def _truncated_file(path: Path, digest: str, tmp: Path) -> tuple[Path, str]:
    bad = shutil.copytree(path, tmp / "1")
    f = sorted(bad.glob("*.safetensors"))[-1]
    os.truncate(f, f.stat().st_size - 100)
    return bad, digest


def _half_written(path: Path, digest: str, tmp: Path) -> tuple[Path, str]:
    return shutil.copytree(path, tmp / ".1.partial"), digest


def _not_safetensors(path: Path, digest: str, tmp: Path) -> tuple[Path, str]:
    bad = shutil.copytree(path, tmp / "1")
    f = sorted(bad.glob("*.safetensors"))[0]
    f.write_bytes(b"\xff" * f.stat().st_size)  # same size: only the header check can tell
    return bad, digest


@pytest.mark.parametrize("corrupt, message", [
    (_wrong_digest, "refusing to load a different version"),
    (_missing_file, "missing (the manifest lists it"),
    (_truncated_file, "truncated"),
    (_half_written, "a hidden directory is a pull in progress"),
    (_not_safetensors, "not a safetensors file"),
])
def test_a_bad_mirror_is_refused_and_the_old_weights_serve_on(servers, versions, tmp_path, corrupt, message):
    a = servers["a"].url
    put_on(a, versions, 2)
    before = tiny_tokens(a)
    steps = plugin_cycle(a, *corrupt(*versions[1], tmp_path), "1")
    status, body = steps["update_weights"]
    assert status == 500 and message in json.loads(body)["error"]["message"], body
    assert steps["resume"][0] == 200
    assert healthy(a) and tiny_tokens(a) == before and weight_version(a) == "2"
    put_on(a, versions, 1)  # and the next good update goes through
    assert weight_version(a) == "1"


def test_bad_update_info_is_refused_and_the_server_recovers(servers, versions):
    a = servers["a"].url
    put_on(a, versions, 2)
    before = tiny_tokens(a)
    with client(a) as c:
        assert c.post("/pause").status_code == 200
        assert c.post("/start_weight_update").status_code == 200
        r = c.post("/update_weights", json={"update_info": {"path": str(versions[1][0]), "digest": versions[1][1],
                                                            "extra": 1}})
        assert r.status_code == 500 and "takes exactly 'path' and 'digest'" in r.text
        assert c.post("/resume").status_code == 200
    assert healthy(a) and tiny_tokens(a) == before


def test_a_failure_after_some_layers_leaves_a_servable_model(servers, versions, tmp_path):
    """A tensor the model does not know, in the last file: the layers before it already hold the
    new weights, the rest keep the old ones. Nothing is left half-loaded: the server generates,
    and the next good update brings exact outputs back."""
    from safetensors.numpy import load_file, save_file

    from rolloutd.wire.manifest import build_manifest

    a = servers["a"].url
    put_on(a, versions, 2)
    before = tiny_tokens(a)
    bad = shutil.copytree(versions[1][0], tmp_path / "1")
    last = sorted(bad.glob("*.safetensors"))[-1]
    tensors = load_file(last)
    tensors["model.layers.1.mlp.not_a_projection.weight"] = next(iter(tensors.values()))
    save_file(tensors, last)
    manifest = build_manifest(1, sorted(bad.glob("*.safetensors")), chunk_bytes=1 << 16)
    (bad / "manifest.json").write_text(manifest.model_dump_json())

    steps = plugin_cycle(a, bad, manifest.digest, "1")
    assert steps["update_weights"][0] == 500 and "not_a_projection" in steps["update_weights"][1]
    assert healthy(a)
    mixed = tiny_tokens(a)  # it serves: no layer was left empty
    assert len(mixed) == len(TINY_PROMPTS)
    put_on(a, versions, 2)
    assert tiny_tokens(a) == before


def test_registration_is_idempotent_with_both_plugin_sources(servers, tmp_path):
    """rolloutd installed in vLLM's environment *and* the daemon's plugin directory: vLLM sees
    the entry point twice, loads plugins more than once, and one engine is registered."""
    injected = install_plugin(tmp_path / "plugin")
    installed = pip_install_rolloutd(tmp_path / "site")
    code = ("from importlib.metadata import entry_points\n"
            "from vllm.plugins import load_general_plugins\n"
            "import vllm.plugins, vllm_plugin\n"
            "load_general_plugins(); vllm.plugins.plugins_loaded = False; load_general_plugins()\n"
            "vllm_plugin.register()\n"
            "from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory as F\n"
            "print(len([e for e in entry_points(group='vllm.general_plugins') if e.name == 'rolloutd']),"
            " F._registry['rolloutd']().__name__)\n")
    env = {**os.environ, "PYTHONPATH": f"{injected}:{installed}", "VLLM_NO_USAGE_STATS": "1"}
    out = subprocess.run([str(ROOT / ".venv-vllm/bin/python"), "-c", code], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == ["2", "RolloutdEngine"]
