"""The layout of tests/ (issue 41): tiers are folders. Every test file is in tests/unit, tests/integration
or tests/system; the system folder marks its tests slow; a unit test opens no socket (no network
module imported by the file or by the support modules it uses, no fixture that serves on loopback)."""

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.system import conftest as system_conftest

TESTS = Path(__file__).resolve().parents[1]
TIERS = ("unit", "integration", "system")
NETWORK = {"socket", "ssl", "httpx", "aiohttp", "http", "urllib", "requests", "websockets", "selenium"}
# the root conftest.py's fixtures that serve or dial on loopback
SERVING_FIXTURES = {"registry", "http", "standalone", "daemons", "s3"}


def tier_files(tier: str) -> list[Path]:
    return sorted((TESTS / tier).rglob("test_*.py"))


def test_every_test_file_is_in_a_tier():
    assert sorted(p.relative_to(TESTS).parts[0] for p in TESTS.rglob("test_*.py")
                  if p.relative_to(TESTS).parts[0] not in TIERS) == []
    assert all(tier_files(tier) for tier in TIERS)


@pytest.mark.parametrize("path", tier_files("system"), ids=lambda p: p.name)
def test_the_system_folder_marks_each_of_its_files_slow(path):
    item = SimpleNamespace(path=path, marks=[])
    item.add_marker = item.marks.append
    system_conftest.pytest_collection_modifyitems([item])
    assert [m.name for m in item.marks] == ["slow"]


def test_every_system_file_has_its_seconds_and_the_longest_files_come_first():
    """scripts/test hands the system tier's files to two workers in this order."""
    paths = tier_files("system")
    assert sorted(system_conftest.SECONDS) == sorted(p.name for p in paths)
    other = tier_files("unit")[:2]
    items = [SimpleNamespace(path=p, marks=[], add_marker=lambda m: None, n=n)
             for p in [*paths, *other] for n in range(2)]
    system_conftest.pytest_collection_modifyitems(items)
    assert [i.path for i in items[:4]] == [other[0], other[0], other[1], other[1]]
    seconds = [system_conftest.SECONDS[i.path.name] for i in items[4:]]
    assert seconds == sorted(seconds, reverse=True) and seconds[0] == max(system_conftest.SECONDS.values())
    assert [i.n for i in items[4:6]] == [0, 1]  # a file's tests keep their order


def test_the_system_folder_marks_nothing_elsewhere():
    for path in tier_files("unit") + tier_files("integration"):
        item = SimpleNamespace(path=path, marks=[])
        item.add_marker = item.marks.append
        system_conftest.pytest_collection_modifyitems([item])
        assert item.marks == [], path


def imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def network_imports(path: Path, seen: set[Path]) -> set[str]:
    """Network modules the file imports, itself or through the tests.support modules it imports."""
    seen.add(path)
    found = {n for n in imports(path) if n.split(".")[0] in NETWORK}
    for name in imports(path):
        if name.startswith("tests.support."):
            support = TESTS.parent / (name.replace(".", "/") + ".py")
            if support.exists() and support not in seen:
                found |= {f"{n} (via {name})" for n in network_imports(support, seen)}
    return found


@pytest.mark.parametrize("path", tier_files("unit"), ids=lambda p: str(p.relative_to(TESTS / "unit")))
def test_a_unit_test_opens_no_socket(path):
    assert network_imports(path, set()) == set()
    requested = {a.arg for node in ast.walk(ast.parse(path.read_text()))
                 if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) for a in node.args.args}
    assert requested & SERVING_FIXTURES == set()


def imported_test_modules(names: set[str]) -> list[str]:
    return sorted(n for n in names if n.startswith("tests.") and n.rsplit(".", 1)[-1].startswith("test_"))


def test_no_test_file_imports_another():
    """What tests share lives in tests/support (or a conftest): a test file (or a support module, or
    a benchmark) importing a test file's helpers would make that file's contents its dependency."""
    readers = [p for tier in TIERS for p in tier_files(tier)] + sorted((TESTS / "support").glob("*.py")) \
        + sorted((TESTS.parent / "bench").glob("*.py"))
    found = {(str(p.relative_to(TESTS)) if TESTS in p.parents else str(p.relative_to(TESTS.parent)), name)
             for p in readers for name in imported_test_modules(imports(p))}
    assert sorted(found) == [], "share it through tests/support instead"
    assert imported_test_modules({"tests.system.test_daemon", "tests.support.served"}) == ["tests.system.test_daemon"]
