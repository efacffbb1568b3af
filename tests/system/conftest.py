"""The system tier: real vLLM, containers, network namespaces, S3, a browser. Every test here is
slow by its folder (``-m "slow and not parallel"``: one at a time, see scripts/test)."""

import pytest

_HERE = __file__.rsplit("/", 1)[0] + "/"


def pytest_collection_modifyitems(items):
    for item in items:
        if str(item.path).startswith(_HERE):
            item.add_marker(pytest.mark.slow)
