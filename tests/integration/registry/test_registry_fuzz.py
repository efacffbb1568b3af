"""Every registry route fuzzed from its own OpenAPI document (schemathesis), with a token:
no 5xx, every answer conforms to the document (status, content type, JSON schema), invalid
input is refused and valid input accepted, and 405s carry the right Allow header; the registry
logs no error and never the token. Headers, paths and bodies outside the document are fuzzed in
test_bad_input.py."""

from __future__ import annotations

import logging
import re
import subprocess
from pathlib import Path

import pytest

from rolloutd.demo.tinymodel import llama_state_dict
from rolloutd.trainer import EmbeddedRegistry
from tests.support.schemathesis_cli import schemathesis

pytestmark = [pytest.mark.slow, pytest.mark.parallel]  # thousands of requests: not the fast tier

SEED = 20261129
CONFIG = Path(__file__).parents[2] / "support" / "schemathesis.toml"
# DELETE /v1/versions/{v} retires a version: by contract its bytes stay readable while a lease
# holds it (test_registry_http.py shows both halves), so "still there after DELETE" is the
# design, not a use after free.
EXCLUDED = "use_after_free"




def test_registry_api_survives_fuzzing(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    (tmp_path / "token").write_text("fuzz-token")
    with EmbeddedRegistry(port=0, token_file=tmp_path / "token", data_dir=tmp_path / "data",
                          max_wait_s=0.2) as reg:
        reg.publish(1, llama_state_dict(1, hidden=64, layers=1, vocab=64, intermediate=64), chunk_bytes=4096)
        run = subprocess.run(
            [schemathesis(), "--config-file", str(CONFIG), "run", f"{reg.url}/openapi.json", "--checks", "all",
             "--exclude-checks", EXCLUDED,
             "-H", "Authorization: Bearer fuzz-token", "--max-examples", "40", "--seed", str(SEED),
             "--request-timeout", "10", "--no-color"],
            capture_output=True, text=True, timeout=900, cwd=tmp_path)  # its cache stays out of the tree
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    cases = re.search(r"(\d+) generated", out)
    assert cases and int(cases.group(1)) > 300, out[-3000:]
    records = [r for r in caplog.records if r.name.startswith(("rolloutd", "uvicorn"))]
    assert [r.getMessage() for r in records if r.exc_info or r.levelno >= logging.ERROR] == []
    assert [r.getMessage() for r in records if "fuzz-token" in r.getMessage()] == []
    print(f"bad-input: registry openapi: {cases.group(1)} cases, 0 failures")
