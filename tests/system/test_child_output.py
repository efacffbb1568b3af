"""The tests of test_child_output.py that run one at a time in the slow tier (slow by this folder): a
real tensor-parallel vLLM's shared memory; the rest is in tests/integration/supervise/test_child_output.py."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import uuid

import httpx
import pytest

from rolloutd.supervise import leftovers
from tests.support.fake_children import held_decoy

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def info_logs(caplog):
    caplog.set_level(logging.DEBUG)


async def until_healthy(client: httpx.AsyncClient, child, timeout_s: float = 300.0) -> None:
    """Poll ``/health`` until 200; fail if the server exits first or ``timeout_s`` passes."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        assert child.running, f"vllm serve exited before it was healthy: {child.describe_exit()}"
        with contextlib.suppress(httpx.HTTPError):
            if (await client.get("/health")).status_code == 200:
                return
        await asyncio.sleep(0.5)
    raise AssertionError(f"vllm serve not healthy within {timeout_s} s")


@pytest.mark.timeout(400)
async def test_a_stopped_tensor_parallel_vllm_leaves_none_of_the_segments_it_held(children, caplog, tmp_path):
    """The real CPU ``vllm serve --tensor-parallel-size 2``, learnt once healthy and stopped as the
    daemon stops it: nothing it held is left in /dev/shm or in its own directory (its TMPDIR), and
    another program's segments (one there before it, one made while it runs, named like its own)
    are untouched."""
    from rolloutd.demo import tinymodel
    from rolloutd.demo.cpu_vllm import CPU_ENV
    from tests.conftest import free_port
    from tests.support.vllm_server import FAST_CPU_FLAGS, VLLM, require_vllm

    require_vllm()
    model = tinymodel.build(tmp_path / "model", seed=0)
    shm, tag = leftovers.SHM_DIR, uuid.uuid4().hex[:8]
    before, during = f"rolloutd-test-decoy-{tag}", f"vllm_dist_{tag}-decoy-cpushm_0"
    decoys = [held_decoy(shm, before)]
    url = f"http://127.0.0.1:{free_port()}"
    child = children("vllm", [str(VLLM), "serve", str(model), "--host", "127.0.0.1", "--port", url.rsplit(":", 1)[1],
                              *FAST_CPU_FLAGS, "--tensor-parallel-size", "2"], scratch=tmp_path / "scratch")
    child.env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    child.env.update(CPU_ENV, VLLM_CPU_OMP_THREADS_BIND="0|1")
    try:
        await child.spawn()
        async with httpx.AsyncClient(base_url=url, timeout=2) as client:
            await until_healthy(client, child)
        decoys.append(held_decoy(shm, during))
        await child.note_shm()  # as the supervisor does once healthy
        held = {n for n in child._shm_held if "/" not in n and (shm / n).exists()}
        assert held, "a TP=2 server holds shared memory of its own while it runs"
        assert not held & {before, during}
        await child.stop(grace_s=20)
        assert not [n for n in held if (shm / n).exists()]
        assert list((tmp_path / "scratch").iterdir()) == [], "its TMPDIR (vLLM's sockets) is left"
        assert (shm / before).exists() and (shm / during).exists()
    finally:
        for decoy in decoys:
            decoy.kill()
            decoy.wait(10)
            decoy.stdout.close()
        for name in (before, during):
            (shm / name).unlink(missing_ok=True)
