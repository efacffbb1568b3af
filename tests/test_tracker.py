"""The registry's tracker (pure logic, injected clock): every chunk goes out of the origin once
however many nodes pull, pullers are handed peers that hold what they lack, and a node that
went silent or that a puller could not use stops counting."""

from __future__ import annotations

import random

from rolloutd.registry.server.tracker import Tracker
from rolloutd.wire.chunkmap import from_hex, full, ones, to_hex
from rolloutd.wire.manifest import FileEntry, Manifest
from rolloutd.wire.messages import Announce, HeldVersion

from .conftest import FakeClock

CHUNKS = 40
MANIFEST = Manifest(version=3, chunk_bytes=4096, files=[
    FileEntry(name="a.safetensors", size=4096 * 25, chunks=["0" * 32] * 25),
    FileEntry(name="b.safetensors", size=4096 * 15, chunks=["1" * 32] * 15)]).sealed()


def manifest_of(version: int):
    return MANIFEST if version == 3 else None


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
    assert tracker.summary()[3]["holders"] == 1  # seed silent: forgotten, only "a" left


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
