"""packaging/build-deb names what the package is made of (``--sources``), once: the tests key
their cache of built packages on those paths (tests.support.nspawn.deb_folder), so a file the
script read from outside them would leave a stale package in the tests."""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "packaging" / "build-deb"


def sources() -> list[str]:
    return subprocess.run([SCRIPT, "--sources"], capture_output=True, text=True, check=True).stdout.split()


def under(path: str, roots: list[str]) -> bool:
    return any(path == r or path.startswith(r + "/") for r in roots)


def files_read(script: str) -> set[str]:
    """The project's files a script names (a path or glob that matches something here), comments aside."""
    code = "\n".join(line for line in script.splitlines() if not line.lstrip().startswith("#"))
    return {tok for tok in re.findall(r"(?<![\w$/.-])\w[\w./*-]*", code)
            if ("/" in tok or "." in tok) and any(ROOT.glob(tok))}


def test_every_file_the_script_reads_is_under_its_sources():
    roots = sources()
    assert roots and all((ROOT / r).exists() for r in roots), roots
    read = files_read(SCRIPT.read_text())
    assert {"systemd/rolloutd.service", "etc/rolloutd.yaml", "docs/*.md", "packaging/debian/postinst"} <= read, read
    assert sorted(t for t in read if not under(t, roots)) == []
    # `pip wheel .` reads the project's packages
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = [p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]]
    assert "pyproject.toml" in roots and [p for p in packages if not under(p, roots)] == []


def test_a_file_read_from_outside_the_sources_is_seen():
    script = SCRIPT.read_text() + '\ninstall -D -m 0644 bench/soak.py "$STAGE/usr/share/rolloutd/soak.py"\n'
    assert sorted(t for t in files_read(script) if not under(t, sources())) == ["bench/soak.py"]
