"""Puts rolloutd's vLLM plugin on a ``vllm serve`` child's import path.

vLLM may be installed anywhere on the node, in an environment that knows nothing of rolloutd.
The daemon copies the plugin package (standard library at import time; it imports torch,
vLLM and safetensors from vLLM's own environment) into a directory of its own, next to a
metadata-only distribution that declares the ``vllm.general_plugins`` entry point, and puts
that directory first on the child's ``PYTHONPATH``. vLLM's plugin loader then finds it exactly
as if it were installed. If rolloutd is also installed in vLLM's environment, both declare the
same entry point name, vLLM keeps one, and registration is idempotent either way.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

import vllm_plugin
from rolloutd import __version__

DIST_NAME = "rolloutd_vllm_plugin"
ENTRY_POINT = f"{vllm_plugin.BACKEND} = vllm_plugin:register"


def install_plugin(dest: Path) -> Path:
    """Write the plugin and its entry-point metadata under ``dest`` (replaced atomically, so a
    child starting meanwhile never sees half of it); returns the directory for PYTHONPATH."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    src = Path(vllm_plugin.__file__).parent
    shutil.copytree(src, staging / "vllm_plugin", ignore=shutil.ignore_patterns("__pycache__"))
    meta = staging / f"{DIST_NAME}-{__version__}.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {DIST_NAME}\nVersion: {__version__}\n")
    (meta / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{ENTRY_POINT}\n")
    old = dest.with_name(f".{dest.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if dest.exists():
        dest.rename(old)
    staging.rename(dest)
    shutil.rmtree(old, ignore_errors=True)
    return dest


def child_env(base: Mapping[str, str], plugin_dir: Path) -> dict[str, str]:
    """``base`` with the plugin directory first on PYTHONPATH and, if the user restricted
    vLLM's plugins with ``VLLM_PLUGINS``, the plugin added to that allow-list."""
    env = dict(base)
    env["PYTHONPATH"] = os.pathsep.join([str(plugin_dir), *filter(None, [env.get("PYTHONPATH")])])
    allowed = env.get("VLLM_PLUGINS")
    if allowed and vllm_plugin.BACKEND not in allowed.split(","):
        env["VLLM_PLUGINS"] = f"{allowed},{vllm_plugin.BACKEND}"
    return env
