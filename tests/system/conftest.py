"""The system tier: real vLLM, containers, network namespaces, a browser. Every test in this folder
is slow by the folder.

scripts/test runs the tier two files at a time, one worker per core (``-m "slow and not parallel
and not alone" -n 2 --dist loadfile --no-loadscope-reorder``): a file's tests stay on one worker,
in their order, so that module fixtures are made once; each worker takes the next file when it is
done with one, and the files come longest first, so that both workers end about together. The
second worker swaps cores 0 and 1 for its servers (tests/support/vllm_server.py, ``worker_cores``).
Tests marked ``alone`` (a deadline raced against the machine's speed) run afterwards with nothing
beside them.
"""

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

# Seconds each file took with another file beside it (a full run, 2 cores: scripts/test prints each
# run's longest files); a new file counts as a minute until it is measured (tests/unit/test_layout.py
# asks for every file's).
SECONDS = {
    "test_model_matrix.py": 280, "test_soak.py": 275, "test_systemd.py": 215, "test_daemon.py": 130,
    "test_package.py": 90, "test_delta_versions.py": 90, "test_trl.py": 70, "test_egress.py": 70,
    "test_fleet_vllm.py": 60, "test_vllm_plugin.py": 60, "test_demo_rl.py": 60, "test_gate.py": 40,
    "test_demo.py": 35, "test_private_socket.py": 35, "test_child_output.py": 30, "test_gateway.py": 30,
    "test_coverage.py": 25, "test_gateway_netns.py": 20, "test_fleet_ui.py": 20, "test_s3_delta.py": 10,
    "test_bench_delta.py": 10, "test_looplag.py": 5, "test_wakeup.py": 5,
    # alone: after the others, one at a time
    "test_parallel.py": 240, "test_engine_kill.py": 45, "test_kv_cache.py": 25,
}


def _here(item) -> bool:
    return HERE in Path(item.path).resolve().parents


def _order(item) -> tuple:
    """Other folders' items first, as they were; then this folder's files, longest first."""
    if not _here(item):
        return (0, 0, "")
    name = Path(item.path).name
    return (1, -SECONDS.get(name, 60), name)


def pytest_collection_modifyitems(items):
    """Called with the whole session's items (the hook is not limited to this folder): marks those
    that stand here slow, and orders their files longest first (a stable sort: a file's tests keep
    their order; every worker orders the same)."""
    for item in items:
        if _here(item):
            item.add_marker(pytest.mark.slow)
    items.sort(key=_order)
