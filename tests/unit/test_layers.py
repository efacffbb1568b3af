"""Imports run downward: a module imports only modules of its own layer or of a layer below, and
no group of modules imports itself round in a circle.

The layers, from the bottom up: the words both ends speak (``wire``); the small shared pieces
(units, config, the HTTP server, leases, metrics, the object store's settings and buckets); the
registry service and the fleet client; the trainer's library (publishing, and its integrations
into trainer libraries), which runs the registry in-process; the node's parts (the gateway, the
rollout of a version with its registry client); the supervisor that composes them per server;
the node that wires everything; then the commands. Every import counts, at the top of a module,
inside a function or under ``TYPE_CHECKING``.

One audience per package: importing the daemon loads neither the trainer's library nor the
registry service.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "rolloutd"

LAYERS: list[set[str]] = [
    {"wire"},
    {"rolloutd", "units", "config", "httpserver", "filelease", "metrics", "objstore"},
    {"registry", "fleet"},
    {"trainer"},
    {"gateway", "rollout"},
    {"supervise"},
    {"node"},
    {"demo"},
    {"cli", "fleetctl"},
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of a rolloutd module in the file, relative ones resolved."""
    here = module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            name = ".".join(base + ([node.module] if node.module else []))
            found.append((node.lineno, name))
            # `from rolloutd.x import y` may name a module y
            found += [(node.lineno, f"{name}.{a.name}") for a in node.names
                      if (PACKAGE.parent / f"{name}.{a.name}".replace(".", "/")).with_suffix(".py").exists()]
    return [(line, name) for line, name in found if name == "rolloutd" or name.startswith("rolloutd.")]


def layer(module: str) -> int:
    unit = module.split(".")[1] if "." in module else module
    for i, names in enumerate(LAYERS):
        if unit in names:
            return i
    raise AssertionError(f"{module} is in no layer: add it to LAYERS")


def graph() -> dict[str, list[tuple[str, int, str]]]:
    """module -> [(file, line, imported module)]."""
    return {module_name(p): [(str(p.relative_to(PACKAGE.parent)), line, name) for line, name in imports(p)]
            for p in sorted(PACKAGE.rglob("*.py"))}


def upward() -> list[str]:
    return [f"{file}:{line}: {mod} imports {name}" for mod, edges in graph().items()
            for file, line, name in edges
            if layer(name) > layer(mod)]


def circles() -> list[list[str]]:
    """Each circle among the modules, found by a depth-first walk (one per back edge)."""
    edges = {mod: sorted({name for _, _, name in e if name != mod}) for mod, e in graph().items()}
    found, state, path = [], {}, []

    def walk(mod: str) -> None:
        state[mod] = "open"
        path.append(mod)
        for name in edges.get(mod, []):
            if state.get(name) == "open":
                found.append(path[path.index(name):] + [name])
            elif name not in state:
                walk(name)
        path.pop()
        state[mod] = "done"

    for mod in edges:
        if mod not in state:
            walk(mod)
    return found


def test_every_module_has_a_layer():
    for mod, edges in graph().items():
        layer(mod)
        for _, _, name in edges:
            layer(name)


def test_imports_run_downward():
    assert upward() == []


def test_no_import_circles():
    assert [" -> ".join(c) for c in circles()] == []


def test_the_daemon_imports_neither_the_trainers_library_nor_the_registry():
    """A node's process holds the node's code only: a fresh interpreter that imports the daemon
    has no module of ``rolloutd.trainer`` (publishing, shards, canaries, integrations) nor of the
    registry service loaded."""
    code = ("import sys, rolloutd.node.daemon\n"
            "print('\\n'.join(sorted(m for m in sys.modules if m.split('.')[:2] in "
            "(['rolloutd', 'trainer'], ['rolloutd', 'registry']))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == []
