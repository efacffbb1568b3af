"""The system tier: real vLLM, containers, network namespaces, a browser. Every test in this folder
is slow by the folder (``-m "slow and not parallel"``: one at a time, see scripts/test)."""

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items):
    """Called with the whole session's items (the hook is not limited to this folder): marks those
    that stand here."""
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.slow)
