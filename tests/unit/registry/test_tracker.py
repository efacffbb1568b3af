"""The registry's tracker (pure logic, injected clock): every chunk goes out of the origin once
however many nodes pull, pullers are handed peers that hold what they lack, and a node that
went silent or that a puller could not use stops counting."""

from __future__ import annotations

import random

from rolloutd.registry.tracker import Tracker
from rolloutd.wire.chunkmap import from_hex, full, ones, to_hex
from rolloutd.wire.manifest import Delta, DeltaFile, FileEntry, Manifest
from rolloutd.wire.messages import Announce, HeldVersion
from tests.conftest import FakeClock

CHUNKS = 40
MANIFEST = Manifest(version=3, chunk_bytes=4096, files=[
    FileEntry(name="a.safetensors", size=4096 * 25, chunks=["0" * 32] * 25),
    FileEntry(name="b.safetensors", size=4096 * 15, chunks=["1" * 32] * 15)]).sealed()


DELTA_CHUNKS = 6
# Version 4: the same files as a delta on version 3; its delta files are 6 chunks in all.
DELTA_VERSION = MANIFEST.model_copy(update={"version": 4, "digest": None}).sealed().with_delta(Delta(
    base_version=3, base_digest=MANIFEST.digest, encoding="xor-planes-zstd", files=[
        DeltaFile(name="a.safetensors.delta", size=4096 * 4, chunks=["2" * 32] * 4, target="a.safetensors"),
        DeltaFile(name="b.safetensors.delta", size=4096 * 2, chunks=["3" * 32] * 2, target="b.safetensors")]))


def manifest_of(version: int):
    return {3: MANIFEST, 4: DELTA_VERSION}.get(version)


def announce(tracker: Tracker, node: str, bits: int | None, *, pulling: bool = True, failed=()) -> dict:
    held = HeldVersion(digest=MANIFEST.digest, chunks=None if bits is None else to_hex(bits), pulling=pulling)
    return tracker.announce(node, Announce(url=f"http://{node}:9300", versions={"3": held}, failed=list(failed)),
                            manifest_of)


def test_origin_chunks_go_out_once_across_pullers():
    tracker = Tracker(clock=FakeClock(), origin_per_puller=4, rng=random.Random(1))
    nodes = [f"n{i}" for i in range(8)]
    held = dict.fromkeys(nodes, 0)
    from_origin: list[int] = []
    for _ in range(200):  # rounds: each node announces, fetches what it was given or a peer has
        for node in nodes:
            view = announce(tracker, node, held[node])["3"] if held[node] != full(CHUNKS) else None
            if view is None:
                continue
            given = from_hex(view["origin"], CHUNKS)
            from_origin += ones(given)
            held[node] |= given
            for peer in view["peers"]:  # take one chunk a peer has
                have = from_hex(peer["chunks"], CHUNKS) & ~held[node]
                if have:
                    held[node] |= have & -have
                    break
        if all(bits == full(CHUNKS) for bits in held.values()):
            break
    assert all(bits == full(CHUNKS) for bits in held.values())
    assert sorted(from_origin) == list(range(CHUNKS))  # each chunk from the origin exactly once


def test_a_complete_holder_is_handed_out_and_no_origin_chunk_is_given():
    tracker = Tracker(clock=FakeClock(), rng=random.Random(2))
    announce(tracker, "seed", None, pulling=False)
    view = announce(tracker, "new", 0)["3"]
    assert from_hex(view["origin"], CHUNKS) == 0
    assert [p["node"] for p in view["peers"]] == ["seed"] and view["peers"][0]["url"] == "http://seed:9300"


def test_at_most_max_peers_drawn_at_random():
    tracker = Tracker(clock=FakeClock(), max_peers=3, rng=random.Random(3))
    for i in range(20):
        announce(tracker, f"h{i}", None, pulling=False)
    seen = set()
    for i in range(30):
        view = announce(tracker, f"p{i}", 0)["3"]
        assert len(view["peers"]) == 3
        seen |= {p["node"] for p in view["peers"]}
    assert len(seen) >= 15  # spread: not the same few holders for everyone


def test_undelivered_origin_chunks_are_taken_back_and_given_again():
    clock = FakeClock()
    tracker = Tracker(clock=clock, assign_ttl_s=10, holder_ttl_s=100, origin_per_puller=4)
    first = from_hex(announce(tracker, "slow", 0)["3"]["origin"], CHUNKS)
    assert first.bit_count() == 16  # alone: four times origin_per_puller
    rest = full(CHUNKS) & ~first  # "other" has everything but what "slow" was given
    assert from_hex(announce(tracker, "other", rest)["3"]["origin"], CHUNKS) == 0
    clock.advance(11)
    tracker.sweep()
    again = from_hex(announce(tracker, "other", rest)["3"]["origin"], CHUNKS)
    assert again and again & ~first == 0  # only what "slow" never delivered, now to "other"


def test_a_silent_node_and_a_failed_peer_stop_counting():
    clock = FakeClock()
    tracker = Tracker(clock=clock, holder_ttl_s=5)
    announce(tracker, "seed", None, pulling=False)
    assert announce(tracker, "a", 0)["3"]["peers"]
    view = announce(tracker, "a", 0, failed=["seed"])["3"]
    assert view["peers"] == [] and from_hex(view["origin"], CHUNKS)  # seed suspect: the origin it is
    clock.advance(6)
    announce(tracker, "a", 1)
    tracker.sweep()
    assert tracker.summary()["3"]["holders"] == 1  # seed silent: forgotten, only "a" left


def test_unknown_versions_and_other_digests_are_ignored():
    tracker = Tracker(clock=FakeClock())
    body = Announce(url="http://x:1", versions={"3": HeldVersion(digest="f" * 64), "9": HeldVersion(digest="e" * 64)})
    assert tracker.announce("x", body, manifest_of) == {}
    assert tracker.summary() == {}


def test_a_holder_that_lost_its_copy_and_pulls_again_is_given_origin_chunks():
    """A node removes a damaged copy and pulls the version again under the same name: what it held
    no longer counts as held anywhere (it once did until it left: the pull took a chunk each
    4 x origin_wait_s)."""
    tracker = Tracker(clock=FakeClock(), rng=random.Random(5))
    announce(tracker, "n", None, pulling=False)  # complete, at rest
    view = announce(tracker, "n", 0)["3"]  # the same node, pulling it again from nothing
    assert from_hex(view["origin"], CHUNKS) != 0


def announce_delta(tracker: Tracker, node: str, bits: int | None, *, pulling: bool = True) -> dict:
    """``node`` pulling version 4 from its delta: its delta files, under the delta section's digest."""
    held = HeldVersion(digest=DELTA_VERSION.delta.digest, chunks=None if bits is None else to_hex(bits),
                       pulling=pulling)
    return tracker.announce(node, Announce(url=f"http://{node}:9300", versions={"4": held}), manifest_of)


def announce_target(tracker: Tracker, node: str, bits: int | None, *, pulling: bool = True) -> dict:
    held = HeldVersion(digest=DELTA_VERSION.digest, chunks=None if bits is None else to_hex(bits), pulling=pulling)
    return tracker.announce(node, Announce(url=f"http://{node}:9300", versions={"4": held}), manifest_of)


def test_a_delta_versions_files_go_out_of_the_origin_once_across_pullers():
    """Eight nodes rebuilding version 4 from its delta: the chunk maps count the delta files'
    chunks, and each delta chunk is handed out of the origin once."""
    tracker = Tracker(clock=FakeClock(), origin_per_puller=2, rng=random.Random(7))
    nodes = [f"n{i}" for i in range(8)]
    held = dict.fromkeys(nodes, 0)
    from_origin: list[int] = []
    for _ in range(50):
        for node in nodes:  # a node announces what it holds until the rebuild is done (as a real one does)
            views = announce_delta(tracker, node, held[node])
            if held[node] == full(DELTA_CHUNKS):
                continue
            view = views["4"]
            given = from_hex(view["origin"], DELTA_CHUNKS)  # a map of the delta files' 6 chunks
            from_origin += ones(given)
            held[node] |= given
            for peer in view["peers"]:
                have = from_hex(peer["chunks"], DELTA_CHUNKS) & ~held[node]
                if have:
                    held[node] |= have & -have
                    break
        if all(bits == full(DELTA_CHUNKS) for bits in held.values()):
            break
    assert all(bits == full(DELTA_CHUNKS) for bits in held.values())
    assert sorted(from_origin) == list(range(DELTA_CHUNKS))
    assert tracker.summary()["4.delta"]["holders"] == 8


def test_delta_pullers_are_sent_to_delta_holders_and_full_pullers_to_target_holders():
    """A node holding version 4 complete has its target's chunks, not its delta files: a delta
    puller is never sent to it (nor a full puller to a node with only delta files)."""
    tracker = Tracker(clock=FakeClock(), rng=random.Random(8))
    announce_target(tracker, "complete", None, pulling=False)
    given = announce_delta(tracker, "rebuilder", 0b11)["4"]["origin"]
    assert from_hex(given, DELTA_CHUNKS) == full(DELTA_CHUNKS) & ~0b11  # the target's holder has none of them
    view = announce_delta(tracker, "delta-puller", 0)["4"]
    assert [p["node"] for p in view["peers"]] == ["rebuilder"]
    assert from_hex(view["peers"][0]["chunks"], DELTA_CHUNKS) == 0b11
    assert from_hex(view["origin"], DELTA_CHUNKS) == 0  # held or given already: not from the origin again
    view = announce_target(tracker, "full-puller", 0)["4"]
    assert [p["node"] for p in view["peers"]] == ["complete"] and from_hex(view["origin"], CHUNKS) == 0
    assert set(tracker.summary()) == {"4", "4.delta"}


def test_a_node_that_committed_its_rebuild_leaves_the_delta_swarm_and_reclaim_forgets_both():
    tracker = Tracker(clock=FakeClock())
    announce_delta(tracker, "a", full(DELTA_CHUNKS))
    announce_target(tracker, "b", None, pulling=False)
    assert tracker.summary()["4.delta"]["complete"] == 1
    announce_target(tracker, "a", None, pulling=False)  # committed: the version, not its delta files
    assert "4.delta" not in tracker.summary() and tracker.summary()["4"]["holders"] == 2
    announce_delta(tracker, "c", 0)
    tracker.forget_version(4)
    assert tracker.summary() == {}


def announce_kept(tracker: Tracker, node: str, delta: str = DELTA_VERSION.delta.digest) -> dict:
    """``node`` holds version 4 complete and keeps the delta files it rebuilt it from."""
    held = HeldVersion(digest=DELTA_VERSION.digest, delta=delta)
    return tracker.announce(node, Announce(url=f"http://{node}:9300", versions={"4": held}), manifest_of)


def test_a_node_keeping_the_delta_files_after_its_commit_holds_the_delta_swarm_complete():
    """A node that rebuilt version 4 and keeps its delta files: delta pullers are sent to it for
    every chunk, none from the origin; full pullers to it as well; once it no longer names
    them (it committed another version) it leaves the delta swarm, and a puller alone takes
    the delta from the origin."""
    tracker = Tracker(clock=FakeClock(), rng=random.Random(9))
    assert announce_kept(tracker, "kept") == {}  # nothing to pull: no view
    assert tracker.summary() == {"4": {"holders": 1, "complete": 1, "pulling": 0, "given": 0},
                                 "4.delta": {"holders": 1, "complete": 1, "pulling": 0, "given": 0}}
    view = announce_delta(tracker, "late", 0)["4"]
    assert [p["node"] for p in view["peers"]] == ["kept"]
    assert from_hex(view["peers"][0]["chunks"], DELTA_CHUNKS) == full(DELTA_CHUNKS)
    assert from_hex(view["origin"], DELTA_CHUNKS) == 0
    view = announce_target(tracker, "full-puller", 0)["4"]
    assert [p["node"] for p in view["peers"]] == ["kept"]
    announce_target(tracker, "kept", None, pulling=False)  # the delta files dropped
    assert tracker.summary()["4.delta"]["complete"] == 0 and tracker.summary()["4"]["complete"] == 1
    view = announce_delta(tracker, "late", 0)["4"]
    assert view["peers"] == [] and from_hex(view["origin"], DELTA_CHUNKS) != 0


def test_kept_delta_files_count_only_beside_the_whole_version_and_with_the_sections_digest():
    tracker = Tracker(clock=FakeClock())
    announce_kept(tracker, "a", delta=DELTA_VERSION.digest)  # the target's digest named as the delta's
    announce_kept(tracker, "b", delta="0" * 64)
    held = HeldVersion(digest=DELTA_VERSION.digest, chunks=to_hex(1), pulling=True, delta=DELTA_VERSION.delta.digest)
    tracker.announce("c", Announce(url="http://c:9300", versions={"4": held}), manifest_of)  # not whole
    assert "4.delta" not in tracker.summary()
    # the field is left out of an announcement without it: the body registries before it accept
    assert "delta" not in HeldVersion(digest=DELTA_VERSION.digest).model_dump_json()


def test_a_digest_that_is_neither_the_target_nor_the_delta_is_ignored():
    tracker = Tracker(clock=FakeClock())
    body = Announce(url="http://x:1", versions={"4": HeldVersion(digest=DELTA_VERSION.delta.base_digest)})
    assert tracker.announce("x", body, manifest_of) == {}
    body = Announce(url="http://x:1", versions={"3": HeldVersion(digest=DELTA_VERSION.delta.digest)})
    assert tracker.announce("x", body, manifest_of) == {}  # version 3 has no delta section
    assert tracker.summary() == {}
