"""The soak's own parts (bench/soak_check.py, bench/soak_faults.py) can fail: the checker tells a
stale, torn or forbidden answer from a right one, and the fake path corrupts exactly one reply."""

from __future__ import annotations

import httpx

from bench.soak_check import PROMPTS, Checker, Trainer
from bench.soak_faults import FakeFaultyPath
from rolloutd.demo import tinymodel
from rolloutd.trainer import EmbeddedRegistry


class Known(Trainer):
    """References set by hand; the continuation of version 3 after any prefix is [7, 7, ...]."""

    def __init__(self):
        super().__init__("http://127.0.0.1:9")
        self.refs = {1: [[1] * 8] * len(PROMPTS), 2: [[2] * 8] * len(PROMPTS), 3: [[3] * 8] * len(PROMPTS)}
        self.bad = {4}

    def continuation(self, version, tokens, count):
        return [7] * count if version == 3 else None


def judge(tokens, spans):
    return Checker("http://admin", "http://registry", Known()).judge(0, tokens, spans)


def span(version, start=0, end=8):
    return {"version": str(version), "start": start, "end": end}


def test_the_checker_judges_answers_by_the_version_that_produced_them():
    assert judge([2] * 8, [span(2)]).kind == "ok"
    assert judge([1] * 8, [span(2)]).kind == "stale"               # labelled 2, weights of 1
    assert judge([2] * 7 + [9], [span(2)]).kind == "torn"           # equal to no version
    assert judge([2] * 8, [span(4)]).kind == "bad_version"          # a version every server must refuse
    assert judge([2] * 8, [span(5)]).kind == "bad_version"          # a version nobody published
    assert judge([2] * 8, []).kind == "bad_version"                 # no label at all
    # cut short (aborted by a restart under it): judged as a prefix
    assert judge([2] * 3, [span(2, 0, 3)]).kind == "ok"
    assert judge([1] * 3, [span(2, 0, 3)]).kind == "stale"
    assert judge([2, 2, 9], [span(2, 0, 3)]).kind == "torn"
    # an update in the middle of the answer: the first span as version 2, the rest as 3 continues it
    assert judge([2] * 3 + [7] * 5, [span(2, 0, 3), span(3, 3, 8)]).kind == "ok_spanning"
    assert judge([2] * 3 + [7] * 4 + [9], [span(2, 0, 3), span(3, 3, 8)]).kind == "torn"
    assert judge([1] * 3 + [7] * 5, [span(2, 0, 3), span(3, 3, 8)]).kind == "torn"  # its first span is not 2
    assert judge([2] * 3 + [7] * 5, [span(2, 0, 3), span(1, 3, 8)]).kind == "unjudged"  # model not kept


def test_the_fake_path_flips_a_byte_of_exactly_one_range_reply():
    with EmbeddedRegistry(port=0) as reg:
        reg.publish(1, tinymodel.state_dict(tinymodel.TINY, 1), shard_bytes=600_000, chunk_bytes=1 << 16)
        name = reg.manifest(1).files[0].name
        path = FakeFaultyPath(reg.port).start()
        try:
            def get() -> bytes:
                r = httpx.get(f"{path.url}/v1/versions/1/files/{name}", headers={"range": "bytes=0-65535"})
                assert r.status_code == 206
                return r.content
            clean = get()
            path.corrupt_next()
            bad, after = get(), get()
        finally:
            path.stop()
    assert len(bad) == len(clean) == 65536 and after == clean
    assert sum(a != b for a, b in zip(bad, clean, strict=True)) == 1
    assert path.corrupted == [f"/v1/versions/1/files/{name} bytes=0-65535"]


def test_a_killed_daemon_s_counters_count_and_its_restart_is_no_leak():
    """The counters of every life add up (the longest stall is kept), and the footprint's drift is
    taken over the longest life: a daemon started again warms up again, which is no leak."""
    from bench.soak import Sampler
    from bench.soak_faults import over_lives

    first = {"updates": 3, "task_errors": 1, "update_failures": {"load": 1}, "restarts": {"s0": 1},
             "loop_stall_max_s": 0.3, "loop_lag_samples": 10, "loop_lag_over_100ms": 2}
    second = {"updates": 4, "task_errors": 0, "update_failures": {"load": 2, "pause": 1},
              "restarts": {"s0": 2, "s1": 1},
              "loop_stall_max_s": 0.1, "loop_lag_samples": 20, "loop_lag_over_100ms": 0}
    assert over_lives([first, second]) == {
        "updates": 7, "task_errors": 1, "update_failures": {"load": 3, "pause": 1}, "restarts": {"s0": 3, "s1": 1},
        "loop_stall_max_s": 0.3, "loop_lag_samples": 30, "loop_lag_over_100ms": 2}

    sampler = Sampler(daemon=None)
    # a first life of 8 samples, killed before it held much; a second of 16, flat and larger:
    # over the whole run that would read as +15 MiB and +6 fds
    sampler.samples = [(t, 60.0, 18, 100) for t in range(8)]
    sampler.samples += [(8 + t, 75.0, 24, 200) for t in range(16)]
    drift = sampler.drift()
    assert drift["samples_longest_life"] == 16 and drift["samples"] == 24
    assert drift["rss_drift_mib"] == 0 and drift["fd_drift"] == 0
    # a leak within that life is seen
    sampler.samples += [(24 + t, 75.0 + 3 * t, 24 + 2 * t, 200) for t in range(8)]
    drift = sampler.drift()
    assert drift["rss_drift_mib"] > 10 and drift["fd_drift"] > 5
