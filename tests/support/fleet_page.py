"""A registry whose fleet page the tests open with a token."""

from __future__ import annotations

import pytest

from rolloutd.trainer import EmbeddedRegistry

TOKEN = "fleet-page-token"


@pytest.fixture
def reg(tmp_path):
    (tmp_path / "token").write_text(TOKEN)
    with EmbeddedRegistry(port=0, token_file=tmp_path / "token") as r:
        yield r
