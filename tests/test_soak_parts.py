"""The soak's own parts (bench/soak_check.py, bench/soak_faults.py) can fail: the checker tells a
stale, torn or forbidden answer from a right one, and the fake path corrupts exactly one reply."""

from __future__ import annotations

import httpx

from bench.soak_check import PROMPTS, Checker, Trainer
from bench.soak_faults import FakeFaultyPath
from rolloutd.demo import tinymodel
from rolloutd.registry import EmbeddedRegistry


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
