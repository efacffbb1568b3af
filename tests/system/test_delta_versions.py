"""Delta versions served exactly: a real registry, real daemons, real CPU ``vllm serve`` with the
plugin, and transformers on each version's weights, computed here (docs/deltas.md).

Each family (one tied, one untied: :mod:`rolloutd.demo.families`) gets one registry (its bytes on
disk) and one node, shared by its tests, which run in file order (each brings the chain it needs
when run alone); one family's world at a time. The node starts on weights A (a model directory);
the trainer publishes version 1 = B whole (``delta=False``), then 2 = C and 3 = D as the registry
chooses: deltas, each one RL-like step after the one before (2 % of the elements move,
:func:`families.sparse_step`; published in bf16 from the fp32 master, every greedy output
changed). After each, the greedy outputs through the server's gateway equal transformers' on that
version's weights, and the node's ``/status`` ``pull`` says how it got there: C and D as deltas,
a small share of the version's bytes fetched.

- tied family: a second node started after D with an empty mirror takes D whole. Held at D (its
  lag policy never moves it) while E and F are published (the first node takes both as deltas),
  its mirror holds D when F's delta needs E: asked to update, it takes F whole.
- untied family: three faults, each at a publish (``fake_fault_at_publish``: on the registry's
  loop, its bytes committed, before the version is visible): a delta section carrying another
  version's delta file (it applies cleanly to the base and rebuilds other weights, with an XOR
  encoding the version before the base: not the target's digests), a delta file corrupted at
  rest on the registry's disk, and a section whose base digest is another version's. The first
  two fail the delta pull, naming the version and the files; the third is refused before a byte
  of its delta is fetched, naming the version and both digests. In each
  the server keeps its version meanwhile, and the node then takes the version whole and serves it
  exactly.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from rolloutd.demo import families
from rolloutd.registry.blobs import DiskBlob
from rolloutd.trainer import EmbeddedRegistry
from rolloutd.wire.manifest import Manifest
from tests.support.daemon_harness import vllm_server
from tests.support.served import NEW_TOKENS, Node, OneAtATime, generate
from tests.support.vllm_server import require_vllm

pytestmark = [pytest.mark.timeout(900), pytest.mark.usefixtures("one_torch_thread")]

TIED, UNTIED = "qwen2", "llama"
# A delta of an RL-like step (2 % of the elements changed) is ~5 % of the version; "well below"
DELTA_AT_MOST = 0.15
HOLD = {"min_version_lag": 1000, "max_update_delay_s": 86400}  # moves only when asked (POST /update)


@dataclass
class World:
    """One family's registry, its first node, and every version published so far."""

    family: str
    tmp: Path
    reg: EmbeddedRegistry
    node: Node
    masters: dict[int, object] = field(default_factory=dict)  # version -> the trainer's fp32 model
    want: dict[int, list[list[int]]] = field(default_factory=dict)  # version -> transformers' outputs
    second: Node | None = None  # the tied family's second node

    @property
    def latest(self) -> int:
        return max(self.masters)

    def publish(self, version: int, **kw) -> Manifest:
        """The next RL-like step of the master, published in bf16; returns the registry's manifest."""
        import copy

        import torch
        prev = self.masters[self.latest] if self.masters else families.hf_model(self.family, 1)
        master = prev if not self.masters else families.sparse_step(prev, version, families.PROMPTS, NEW_TOKENS,
                                                                    rounded=True)
        self.masters[version] = master
        self.want[version], margins = families.greedy_and_margins(families.bf16_rounded(master), families.PROMPTS,
                                                                  NEW_TOKENS)
        assert min(margins) > 1e-3, "a near tie: pick other weights"
        self.reg.publish(version, copy.deepcopy(master).to(torch.bfloat16), **kw)
        return self.reg.manifest(version)

    def close(self) -> None:
        with contextlib.ExitStack() as closing:  # the nodes first (the second, then the first), then the registry
            closing.callback(self.reg.stop)
            for node in [self.node, *([self.second] if self.second else [])]:
                closing.callback(node.close)


def start_node(world_tmp: Path, registry: EmbeddedRegistry, model: Path, name: str, cpus: str, **sections) -> Node:
    """Node ``name`` of a world (its server on ``cpus``), following the world's registry, SERVING."""
    d = world_tmp / name
    d.mkdir()
    node = Node(d, [vllm_server("s0", model, cpus)], registry,
                node={"name": name, "advertise_host": "127.0.0.1"}, **sections)
    try:
        node.serving()
    except BaseException:
        node.kill()
        raise
    return node


def open_world(tmp_factory, family: str) -> World:
    """A family's world: its registry (versions on disk) and its first node, on weights A."""
    tmp = tmp_factory.mktemp(family)
    reg = EmbeddedRegistry(port=0, data_dir=str(tmp / "registry")).start()
    try:
        start = families.build(tmp / "A", family, seed=0)
        node = start_node(tmp, reg, start, "node-a", "0")
    except BaseException:
        reg.stop()
        raise
    return World(family, tmp, reg, node)


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    """One family's world at a time: the other's servers would only take the cores."""
    require_vllm()
    w = OneAtATime(lambda family: open_world(tmp_path_factory, family))
    yield w
    w.close()


def served_exactly(world: World, node: Node, version: int, seen: list | None = None) -> dict:
    """Wait for ``node`` SERVING ``version`` (every state of its server on the way in ``seen``);
    its greedy outputs through the gateway equal transformers' on that version; its /status."""
    daemon = node.daemon

    def there(st: dict) -> bool:
        s0 = daemon.server("s0", st)
        if seen is not None and (not seen or seen[-1] != (s0["state"], s0["version"])):
            seen.append((s0["state"], s0["version"]))
        return (s0["state"], s0["version"]) == ("SERVING", version)
    st = daemon.wait(there, 180, f"serving version {version}")
    got, labels = generate(node.gateway("s0"), families.PROMPTS)
    assert labels == {str(version)}, labels
    assert got == world.want[version], f"version {version}: served {got}, transformers {world.want[version]}"
    return st


def pulled(st: dict, version: int) -> dict:
    pull = st["pull"]
    assert pull["version"] == version and pull["state"] == "done", pull
    return pull


def assert_delta_pull(st: dict, version: int, base: int) -> None:
    pull = pulled(st, version)
    assert (pull["kind"], pull["base"], pull["delta_error"]) == ("delta", base, None), pull
    assert 0 < pull["bytes_fetched"] <= DELTA_AT_MOST * pull["version_bytes"], pull
    assert pull["reconstruct_s"] is not None, pull


def assert_full_pull(st: dict, version: int) -> dict:
    pull = pulled(st, version)
    assert (pull["kind"], pull["base"]) == ("full", None), pull
    assert pull["bytes_fetched"] >= pull["version_bytes"] > 0, pull
    return pull


def chain(world: World) -> None:
    """A (the start model) -> B whole -> C delta on B -> D delta on C, each served exactly."""
    if world.masters:
        assert world.latest >= 3, "a test before this one stopped half-way through the chain"
        return
    a = families.greedy(families.hf_model(world.family, 0), families.PROMPTS, NEW_TOKENS)
    assert generate(world.node.gateway("s0"), families.PROMPTS)[0] == a, "the start model differs from transformers'"
    m = world.publish(1, delta=False)  # B
    assert m.delta is None, "delta=False must publish a full version"
    assert all(x != y for x, y in zip(a, world.want[1], strict=True)), "B must give other outputs than A"
    assert pulled(served_exactly(world, world.node, 1), 1)["kind"] == "full"
    for version, base in ((2, 1), (3, 2)):  # C, D
        m = world.publish(version)
        assert m.delta is not None and m.delta.base_version == base, m.delta
        assert_delta_pull(served_exactly(world, world.node, version), version, base)


# -- the tied family ---------------------------------------------------------------------------------

def test_tied_family_full_then_delta_versions_are_served_exactly(worlds):
    chain(worlds.get(TIED))


def test_a_node_started_after_the_deltas_takes_the_version_whole(worlds):
    world = worlds.get(TIED)
    chain(world)
    if world.second is None:
        world.second = start_node(world.tmp, world.reg, world.tmp / "A", "node-b", "1", update=HOLD)
    assert_full_pull(served_exactly(world, world.second, 3), 3)


def test_a_node_whose_mirror_lacks_the_base_takes_the_version_whole(worlds):
    world = worlds.get(TIED)
    if world.second is None:
        test_a_node_started_after_the_deltas_takes_the_version_whole(worlds)
    held = world.latest  # the second node holds it and stays there until asked
    for version in (held + 1, held + 2):  # E (delta on D), F (delta on E: the second node lacks E)
        m = world.publish(version)
        assert m.delta is not None and m.delta.base_version == version - 1, m.delta
        assert_delta_pull(served_exactly(world, world.node, version), version, version - 1)
    second = world.second.daemon
    assert second.server("s0")["version"] == held and second.status()["mirror"]["versions"] == [held]
    assert second.action("/update").status_code == 200
    pull = assert_full_pull(served_exactly(world, world.second, held + 2), held + 2)
    assert pull["delta_error"] is None, pull  # no base is no failure: the full version is the way


# -- the untied family: faults ---------------------------------------------------------------------

def test_untied_family_full_then_delta_versions_are_served_exactly(worlds):
    chain(worlds.get(UNTIED))


@contextlib.contextmanager
def fake_fault_at_publish(reg: EmbeddedRegistry, fault: Callable[[Manifest, dict], Manifest]) -> Iterator[None]:
    """The next version the registry makes visible goes through ``fault(manifest, blobs)`` first (on
    the registry's loop, its bytes committed, before any node can see it): a fault of the
    registry's disk or of its encoder, which no real component shows on demand."""
    store = reg.service.store
    real = store.publish

    def publish(manifest: Manifest, blobs: dict, *args, **kw):
        store.publish = real
        return real(fault(manifest, blobs), blobs, *args, **kw)
    store.publish = publish
    try:
        yield
    finally:
        store.publish = real


def corrupt_delta_at_rest(manifest: Manifest, blobs: dict) -> Manifest:
    """A disk fault on the registry: bytes in the middle of the version's delta file flipped."""
    (f,) = manifest.delta.files
    blob = blobs[f.name]
    assert isinstance(blob, DiskBlob), blob
    fd = os.open(blob.path, os.O_RDWR)
    try:
        at = f.size // 2
        os.pwrite(fd, bytes(b ^ 0xFF for b in os.pread(fd, 64, at)), at)
    finally:
        os.close(fd)
    return manifest


def wrong_base_digest(other: str) -> Callable[[Manifest, dict], Manifest]:
    """The section names its base version with the digest of another version, re-sealed."""
    def fault(manifest: Manifest, blobs: dict) -> Manifest:
        return manifest.with_delta(manifest.delta.model_copy(update={"base_digest": other, "digest": None}))
    return fault


def delta_of(reg: EmbeddedRegistry, donor: int) -> Callable[[Manifest, dict], Manifest]:
    """The section carries version ``donor``'s delta file (it rebuilds ``donor`` from the version
    before it; applied on ``donor``, an XOR delta gives that version back), re-sealed, with its
    bytes: a delta section that applies cleanly to the base but does not make the target."""
    theirs = reg.manifest(donor).delta
    (donor_file,) = theirs.files

    def fault(manifest: Manifest, blobs: dict) -> Manifest:
        (mine,) = manifest.delta.files
        path = blobs[mine.name].path
        shutil.copyfile(path.parent.parent / str(donor) / donor_file.name, path)
        blobs[mine.name] = DiskBlob(path, donor_file.size)
        files = [donor_file.model_copy(update={"name": mine.name, "target": mine.target})]
        return manifest.with_delta(manifest.delta.model_copy(update={"files": files, "digest": None}))
    return fault


def refused_then_whole(world: World, fault) -> tuple[Manifest, dict, str]:
    """Publish the next version through ``fault``; the server keeps its version until the node has
    the new one, which it then serves exactly, pulled whole. Returns the manifest as published,
    the node's /status pull, and the node's log since the publish."""
    before, version = world.latest, world.latest + 1
    seen: list = []
    log_at = len(world.node.daemon.log_text())
    with fake_fault_at_publish(world.reg, fault):
        m = world.publish(version)
    assert m.delta is not None and m.delta.base_version == before
    st = served_exactly(world, world.node, version, seen)
    assert {v for _, v in seen} <= {before, version}, seen  # no other version, ever
    pull = assert_full_pull(st, version)
    log = world.node.daemon.log_text()[log_at:]
    return m, pull, log


def failed(version: int, pull: dict, log: str, *names: str) -> str:
    """The delta pull failed: said at WARNING and in /status pull.delta_error, naming the version
    and ``names`` (files), before the whole version was pulled; returns the reason."""
    why = pull["delta_error"]
    assert why and f"version {version}" in why and all(n in why for n in names), pull
    warning = log.index(f"pull version {version} whole: its delta pull failed: ")
    assert warning < log.index(f"pulled version {version}:"), log
    return why


def test_a_delta_whose_rebuild_differs_from_the_target_is_refused(worlds):
    world = worlds.get(UNTIED)
    chain(world)
    donor = world.latest  # a delta version whose delta file is sound
    assert world.reg.manifest(donor).delta is not None
    m, pull, log = refused_then_whole(world, delta_of(world.reg, donor))
    (target,) = m.files
    why = failed(m.version, pull, log, target.name, m.delta.files[0].name)
    assert "the rebuilt bytes differ from the version's digests" in why, why


def test_a_delta_file_corrupted_on_the_registrys_disk_is_refused(worlds):
    world = worlds.get(UNTIED)
    chain(world)
    m, pull, log = refused_then_whole(world, corrupt_delta_at_rest)
    failed(m.version, pull, log, m.delta.files[0].name)
    assert pull["retries"] >= 1, pull  # the chunk was asked for again before the delta was given up


def test_a_delta_with_a_wrong_base_digest_is_refused_and_never_applied(worlds):
    """The registry the node follows gave it the base under one digest and the delta section names
    another: refused with a clear error (WARNING, /status pull.delta_error) before a byte of the
    delta is fetched, and the version taken whole."""
    world = worlds.get(UNTIED)
    chain(world)
    base = world.latest
    held, other = world.reg.manifest(base).digest, world.reg.manifest(base - 1).digest  # a real digest
    m, pull, log = refused_then_whole(world, wrong_base_digest(other))
    assert m.delta.base_digest == other
    assert pull["bytes_fetched"] == pull["version_bytes"], pull  # not a byte of the delta
    why = failed(m.version, pull, log)
    assert why == (f"version {m.version}: its delta names base version {base} with digest {other[:12]}..., but "
                   f"this registry's version {base} in the mirror has digest {held[:12]}..."), why
