"""``rolloutd.fleet`` against a real registry over HTTP and fake generation servers
(tests/support/fake_replica.py) that act out, on cue, what real servers do rarely: refusals, a server
dying mid-request, an answer cut short by an abort-mode update. tests/system/test_fleet_vllm.py shows
the same on real ``vllm serve`` processes behind the daemon's gateways."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from rolloutd.fleet import (
    Fleet,
    FleetSync,
    NoReplica,
    PromptTooLong,
    Rejected,
    RetriesExhausted,
    Sampling,
    Span,
    Unauthorized,
    VersionRefused,
)
from rolloutd.wire import version_contract as contract
from tests.conftest import free_port
from tests.support.fake_replica import FakeReplica
from tests.support.waiting import until

PROMPT = [1, 5, 9]


@pytest.fixture
def fakes():
    made: list[FakeReplica] = []

    def make(label: str = "1", **kw) -> FakeReplica:
        made.append(FakeReplica(label, **kw).start())
        return made[-1]
    yield make
    for f in made:
        f.stop()


def listed(http, fake: FakeReplica, version: int | None, state: str = "SERVING", incarnation: int = 1) -> str:
    """Heartbeat ``fake`` into the registry's directory, as its daemon would; its replica id."""
    rid = f"fake-node.s{fake.port}"
    r = http.put(f"/v1/replicas/{rid}", json=fake.heartbeat(version, state, incarnation))
    assert r.status_code == 200, r.text
    return rid


def publish(registry, version: int) -> None:
    registry.publish(version, {"model.embed_tokens.weight": np.full((4, 4), version, np.float32)})


def fleet_of(registry, **kw) -> Fleet:
    return Fleet(registry.url, **{"refresh_s": 0.1, "wait_s": 2.0, "timeout_s": 20.0, **kw})


# -- discovery ---------------------------------------------------------------------------------------

async def test_replicas_come_and_go_with_the_directory_without_a_restart(registry, http, clock, fakes):
    a, b = fakes(), fakes()
    listed(http, a, 1)
    async with fleet_of(registry) as fleet:
        assert [r["endpoint"] for r in fleet.replicas()] == [a.url]
        rid_b = listed(http, b, 1)
        await until(lambda: len(fleet.replicas()) == 2)
        outs = await fleet.generate_many([PROMPT] * 6, Sampling(max_tokens=3))
        assert {o.replica for o in outs} == {f"fake-node.s{a.port}", rid_b}
        http.delete(f"/v1/replicas/{rid_b}")  # its node stopped
        await until(lambda: len(fleet.replicas()) == 1)
        assert {(await fleet.generate(PROMPT)).replica for _ in range(4)} == {f"fake-node.s{a.port}"}
        listed(http, b, 1, state="STARTING")  # back, not serving yet: listed, never used
        await until(lambda: len(fleet.replicas()) == 2)
        assert {(await fleet.generate(PROMPT)).replica for _ in range(4)} == {f"fake-node.s{a.port}"}
        clock.advance(60)  # a's node went silent: its heartbeats are 60 s old
        await until(lambda: min(r["age_s"] for r in fleet.replicas()) >= 60)
        with pytest.raises(NoReplica, match="no replica within"):
            await fleet.generate(PROMPT, timeout_s=5)


async def test_start_fails_when_the_registry_cannot_be_read():
    with pytest.raises(Exception, match="cannot read the registry's directory"):
        async with Fleet(f"http://127.0.0.1:{free_port()}"):
            pass


# -- routing ---------------------------------------------------------------------------------------

async def test_least_in_flight_spreads_concurrent_requests_evenly(registry, http, fakes):
    a, b = fakes(delay_s=0.3), fakes(delay_s=0.3)
    listed(http, a, 1)
    listed(http, b, 1)
    async with fleet_of(registry) as fleet:
        outs = await fleet.generate_many([PROMPT] * 8, Sampling(max_tokens=2))
    assert len(a.requests) == len(b.requests) == 4
    assert a.most_in_flight == b.most_in_flight == 4
    assert len(outs) == 8 and all(o.token_ids == [10, 11] for o in outs)


async def test_a_session_sticks_to_its_replica_until_that_replica_goes(registry, http, fakes):
    a, b = fakes(), fakes()
    rid_a, rid_b = listed(http, a, 1), listed(http, b, 1)
    async with fleet_of(registry) as fleet:
        first = (await fleet.generate(PROMPT, session="episode-7")).replica
        assert {(await fleet.generate(PROMPT, session="episode-7")).replica for _ in range(5)} == {first}
        other = {(await fleet.generate(PROMPT, session=f"episode-{i}")).replica for i in range(10)}
        assert other == {rid_a, rid_b}  # other sessions still spread
        http.delete(f"/v1/replicas/{first}")
        await until(lambda: len(fleet.replicas()) == 1)
        moved = (await fleet.generate(PROMPT, session="episode-7")).replica
        assert moved != first
        listed(http, a if first == rid_a else b, 1)
        await until(lambda: len(fleet.replicas()) == 2)
        assert (await fleet.generate(PROMPT, session="episode-7")).replica == moved  # stuck where it moved


# -- the version contract -------------------------------------------------------------------------

async def test_min_version_and_max_lag_route_to_replicas_at_that_version(registry, http, fakes):
    old, new = fakes("1"), fakes("2")
    listed(http, old, 1)
    rid_new = listed(http, new, 2)
    publish(registry, 1)
    publish(registry, 2)
    async with fleet_of(registry) as fleet:
        assert fleet.newest == 2
        for kw in ({"min_version": 2}, {"max_lag": 0}):
            outs = await fleet.generate_many([PROMPT] * 6, Sampling(max_tokens=2), **kw)
            assert {o.replica for o in outs} == {rid_new}, kw
            assert all(o.weight_versions == [Span(2, 0, 2)] for o in outs)
        assert all(r["headers"][contract.MIN_VERSION_HEADER] == "2" for r in new.requests)
        assert {o.replica for o in await fleet.generate_many([PROMPT] * 6, max_lag=1)} == \
            {rid_new, f"fake-node.s{old.port}"}
        assert {r["headers"][contract.MIN_VERSION_HEADER] for r in new.requests[-3:] + old.requests} == {"1"}
        plain = await fleet.generate(PROMPT)
        assert contract.MIN_VERSION_HEADER not in (new if plain.replica == rid_new else old).requests[-1]["headers"]
        with pytest.raises(NoReplica, match="at version >= 3"):
            await fleet.generate(PROMPT, min_version=3, timeout_s=5)


async def test_a_gateway_refusal_sends_the_request_to_a_replica_at_the_version(registry, http, fakes):
    stale, good = fakes("1"), fakes("2")
    stale.script = ["409"]  # listed at 2, but its gateway says it holds 1
    rid_stale, rid_good = listed(http, stale, 2), listed(http, good, 2)
    async with fleet_of(registry) as fleet:
        outs = [await fleet.generate(PROMPT, min_version=2) for _ in range(4)]
        assert {o.replica for o in outs} == {rid_good}
        assert len(stale.requests) == 1 and fleet.stats["retry_behind"] == 1
        view = {r["replica_id"]: r for r in fleet.replicas()}
        assert view[rid_stale]["version"] == 1  # what its refusal said, until the directory says more
        assert (await fleet.generate(PROMPT)).replica in (rid_stale, rid_good)  # no contract: both qualify
        listed(http, stale, 3)
        await until(lambda: {r["replica_id"]: r for r in fleet.replicas()}[rid_stale]["version"] == 3)


async def test_an_answer_from_older_weights_is_never_passed_on(registry, http, fakes):
    """A server whose gateway does not check the header (it answers from version 1 while listed
    at 2): the client checks the answer's weight_versions itself."""
    liar, good = fakes("1"), fakes("2")
    listed(http, liar, 2)
    rid_good = listed(http, good, 2)
    async with fleet_of(registry) as fleet:
        outs = await fleet.generate_many([PROMPT] * 6, min_version=2)
    assert {o.replica for o in outs} == {rid_good}
    assert all(o.min_version == 2 for o in outs)
    assert fleet.stats["retry_behind"] >= 1


# -- retries -----------------------------------------------------------------------------------------

async def test_a_503_is_retried_elsewhere_and_its_replica_avoided_for_retry_after(registry, http, fakes):
    paused, up = fakes(), fakes()
    paused.script, paused.retry_after = ["503"], "1.5"
    rid_paused, rid_up = listed(http, paused, 1), listed(http, up, 1)
    async with fleet_of(registry) as fleet:
        fleet.router._turn = _counter_starting_with(fleet, rid_paused)
        out = await fleet.generate(PROMPT)
        assert out.replica == rid_up and out.attempts == 2
        started = time.monotonic()
        assert {(await fleet.generate(PROMPT)).replica for _ in range(5)} == {rid_up}  # avoided meanwhile
        await until(lambda: time.monotonic() - started > 1.6)
        assert rid_paused in {(await fleet.generate(PROMPT)).replica for _ in range(4)}  # back once it passed


def _counter_starting_with(fleet: Fleet, rid: str):
    """A turn counter under which the first tie goes to ``rid``."""
    import itertools
    order = [r.replica_id for r in fleet.directory.usable()]
    return itertools.count(order.index(rid))


async def test_a_server_that_dies_mid_request_is_retried_elsewhere_with_one_answer(registry, http, fakes):
    dying, up = fakes(delay_s=0.1), fakes(delay_s=0.1)
    dying.script = ["drop"]
    rid_dying, rid_up = listed(http, dying, 1), listed(http, up, 1)
    async with fleet_of(registry) as fleet:
        fleet.router._turn = _counter_starting_with(fleet, rid_dying)
        out = await fleet.generate(PROMPT, Sampling(max_tokens=4))
    assert out.replica == rid_up and out.replicas == [rid_up] and out.attempts == 2
    assert out.token_ids == [10, 11, 12, 13] and fleet.stats["retry_lost"] == 1
    assert len(dying.requests) == 1 and len(up.requests) == 1


async def test_connection_refused_and_server_errors_are_retried_then_exhausted(registry, http, fakes):
    gone = FakeReplica()  # listed, never started: nothing listens on its port
    broken = fakes()
    broken.script = ["500"] * 10
    listed(http, gone, 1)
    listed(http, broken, 1)
    async with fleet_of(registry, max_attempts=3, avoid_initial_s=0.01) as fleet:
        with pytest.raises(RetriesExhausted) as e:
            await fleet.generate(PROMPT)
    whys = [why for _, why in e.value.attempts]
    assert len(whys) == 3
    assert any(w.startswith("cannot connect") for w in whys) and any("HTTP 500" in w for w in whys)


async def test_a_malformed_answer_is_a_failure_of_that_replica(registry, http, fakes):
    bad, good = fakes(), fakes()
    bad.script = ["bad"]
    rid_bad, rid_good = listed(http, bad, 1), listed(http, good, 1)
    async with fleet_of(registry) as fleet:
        fleet.router._turn = _counter_starting_with(fleet, rid_bad)
        out = await fleet.generate(PROMPT)
    assert out.replica == rid_good and fleet.stats["retry_bad_answer"] == 1


async def test_a_request_refused_as_such_is_raised_at_once(registry, http, fakes):
    f = fakes()
    listed(http, f, 1)
    async with fleet_of(registry) as fleet:
        f.script = ["400"]
        with pytest.raises(Rejected, match="HTTP 400 fake: scripted 400") as e:
            await fleet.generate(PROMPT)
        assert e.value.status == 400 and len(f.requests) == 1
        f.script = ["401"]
        with pytest.raises(Unauthorized):
            await fleet.generate(PROMPT)


# -- budget and continuation -------------------------------------------------------------------------

async def test_the_budget_is_clamped_to_the_servers_max_model_len(registry, http, fakes):
    f = fakes(max_model_len=32)
    listed(http, f, 1)
    async with fleet_of(registry) as fleet:
        out = await fleet.generate(list(range(1, 21)), Sampling(max_tokens=1000))
        assert len(out.token_ids) == 12 and out.finish_reason == "length"
        assert f.requests[-1]["body"]["sampling_params"]["max_tokens"] == 12
        with pytest.raises(PromptTooLong):
            await fleet.generate(list(range(1, 33)))


async def test_an_abort_mode_update_is_continued_on_the_new_weights_within_the_budget(registry, http, fakes):
    f = fakes("1", max_model_len=64)
    f.script = ["abort:5>2"]  # aborted after 5 tokens for an update to version 2
    rid = listed(http, f, 1)
    async with fleet_of(registry) as fleet:
        prompt = list(range(1, 11))
        out = await fleet.generate(prompt, Sampling(max_tokens=100, seed=3))
    assert out.weight_versions == [Span(1, 0, 5), Span(2, 5, 54)]
    assert len(out.token_ids) == 54 == 64 - len(prompt)  # the budget re-clamped against max_model_len
    assert out.finish_reason == "length" and out.continuations == 1 and out.replicas == [rid, rid]
    first, second = (r["body"] for r in f.requests)
    assert second["token_ids"] == prompt + out.token_ids[:5]
    assert first["sampling_params"]["max_tokens"] == 54 and second["sampling_params"]["max_tokens"] == 49
    assert second["sampling_params"]["seed"] == 3


async def test_a_continuation_keeps_the_callers_budget(registry, http, fakes):
    f = fakes("1", max_model_len=1000)
    f.script = ["abort:3", "abort:0", "abort:4"]
    listed(http, f, 1)
    async with fleet_of(registry) as fleet:
        out = await fleet.generate([7], Sampling(max_tokens=10))
    assert len(out.token_ids) == 10 and out.continuations == 2 and out.attempts == 4
    assert [r["body"]["sampling_params"]["max_tokens"] for r in f.requests] == [10, 7, 7, 3]


# -- what is passed through ----------------------------------------------------------------------------

async def test_sampling_settings_are_passed_through_and_top_logprobs_come_back(registry, http, fakes):
    f = fakes()
    listed(http, f, 1)
    s = Sampling(max_tokens=3, temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, seed=11, ignore_eos=True,
                 stop_token_ids=(2,), top_logprobs=3, extra={"repetition_penalty": 1.1})
    async with fleet_of(registry, gateway_token="gw-t0ken") as fleet:
        out = await fleet.generate(PROMPT, s)
    sent = f.requests[0]
    assert sent["body"]["sampling_params"] == {
        "max_tokens": 3, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "seed": 11,
        "ignore_eos": True, "stop_token_ids": [2], "logprobs": 4, "repetition_penalty": 1.1}  # (one more: see Sampling)
    assert sent["body"]["token_ids"] == PROMPT and sent["body"]["stream"] is False
    assert sent["headers"]["Authorization"] == "Bearer gw-t0ken"
    assert out.logprobs == [-9.0] * 3
    assert out.top_logprobs == [[(901, -0.25), (902, -0.5), (903, -0.75)]] * 3  # ranked, the sampled one left out


def test_sampling_refuses_what_it_cannot_honour():
    for bad in ({"max_tokens": 0}, {"top_p": 0}, {"temperature": -1},
                {"logprobs": False, "top_logprobs": 2}, {"top_logprobs": 20}, {"extra": {"max_tokens": 3}}):
        with pytest.raises(ValueError):
            Sampling(**bad)


# -- abort and the blocking façade ------------------------------------------------------------------

async def test_cancelling_a_request_ends_it_on_the_server(registry, http, fakes):
    f = fakes()
    f.script = ["hang"]
    listed(http, f, 1)
    async with fleet_of(registry) as fleet:
        task = asyncio.ensure_future(fleet.generate(PROMPT))
        await until(lambda: f.in_flight == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await until(f.cancelled.is_set)
        assert fleet.replicas()[0]["in_flight"] == 0


def test_the_blocking_facade_generates_and_aborts(registry, http, fakes):
    f = fakes()
    listed(http, f, 1)
    with FleetSync(registry.url, refresh_s=0.1) as fleet:
        assert fleet.generate(PROMPT, Sampling(max_tokens=2)).token_ids == [10, 11]
        assert [o.token_ids for o in fleet.generate_many([[1], [2]], Sampling(max_tokens=1))] == [[2], [3]]
        f.script = ["hang"]
        future = fleet.submit(PROMPT)
        deadline = time.monotonic() + 5
        while f.in_flight == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        future.cancel()
        assert f.cancelled.wait(5)
        assert fleet.stats["requests"] == 4 and fleet.replicas()[0]["in_flight"] == 0


async def test_a_request_ended_early_at_the_models_length_is_complete(registry, http, fakes):
    f = fakes(max_model_len=20)
    f.script = ["abort:10"]  # every token it had room for, then aborted by an update
    listed(http, f, 1)
    async with fleet_of(registry) as fleet:
        out = await fleet.generate(list(range(1, 11)), Sampling(max_tokens=100))
    assert len(out.token_ids) == 10 and out.finish_reason == "length" and out.attempts == 1
    assert len(f.requests) == 1


async def test_wait_for_a_version_the_nodes_refused_fails_at_once_with_why(registry, http, fakes):
    publish(registry, 1)
    publish(registry, 2)
    digest = registry.manifest(2).digest
    a, b = fakes("1"), fakes("1")
    why = "version 2 failed the gate 2 time(s): gate: canary mismatch"
    for fake, refused in ((a, [{"version": 2, "digest": digest, "reason": why}]),
                          (b, [{"version": 2, "digest": "0" * 64, "reason": "other bytes under that number"}])):
        r = http.put(f"/v1/replicas/fake-node.s{fake.port}", json={**fake.heartbeat(1), "refused": refused})
        assert r.status_code == 200, r.text
    async with fleet_of(registry) as fleet:
        assert len(fleet.directory.refusing(2)) == 1, "a refusal of other bytes is none"
        t0 = time.monotonic()
        with pytest.raises(VersionRefused, match="their nodes refused version 2") as e:
            await fleet.wait_for(2, n=2, timeout_s=30)
        assert time.monotonic() - t0 < 5 and e.value.reasons == [why]
        with pytest.raises(NoReplica, match="1 of 1|0 of 1"):  # b may still get there: wait, then time out
            await fleet.wait_for(2, n=1, timeout_s=0.3)
