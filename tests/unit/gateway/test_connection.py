"""The gateway's client connection without sockets (rolloutd/gateway/connection.py): fed bytes,
events and the time, it returns actions. Its states arrow by arrow, each state's clock, its
bounds, and a fuzz of random byte splits and events (hypothesis)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rolloutd.config import Gateway as GatewaySettings
from rolloutd.gateway.connection import (
    ARROWS,
    PIPELINE_MAX,
    Connection,
    Do,
    IllegalArrow,
    Reading,
)
from rolloutd.gateway.exchange import Exchange
from rolloutd.gateway.policy import Policy
from rolloutd.metrics import Metrics
from rolloutd.wire.states import ServerState

TOKEN = "conn-token"
LIMIT = 4096
SETTINGS = GatewaySettings.model_validate({"host": "127.0.0.1", "max_body_bytes": f"{LIMIT}B", "head_timeout_s": 10,
                                           "body_timeout_s": 20, "idle_timeout_s": 30})
AUTH = f"Authorization: Bearer {TOKEN}\r\n"


def connection(token: str | None = TOKEN, now: float = 100.0) -> Connection:
    policy = Policy("gpu0", SETTINGS, token, Metrics())
    policy.on_state(ServerState.SERVING)
    conn = Connection(policy, SETTINGS)
    assert conn.start(now) == []
    return conn


def request(body: bytes = b"", path: str = "/v1/completions", auth: str = AUTH, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\n{auth}{extra}Content-Length: {len(body)}\r\n\r\n").encode() + body


def kinds(actions) -> list[Do]:
    return [do for do, _ in actions]


def written(actions) -> bytes:
    return b"".join(arg for do, arg in actions if do is Do.WRITE)


def status_of(data: bytes) -> int:
    return int(data.split(b" ", 2)[1])


# -- the table ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("old", "new"), [(a, b) for a, b in itertools.product(Reading, Reading)
                                          if a is not b and b not in ARROWS[a]])
def test_an_arrow_not_in_the_table_raises(old, new):
    conn = connection()
    conn.state = old
    with pytest.raises(IllegalArrow, match=f"{old.name} -> {new.name}"):
        conn._set_state(new)
    assert conn.state is old


def test_an_illegal_arrow_met_while_parsing_raises_rather_than_answering_400(monkeypatch):
    """llhttp wraps what a callback raises in a parser error; the connection must not take that
    for bad input from the client."""
    monkeypatch.setitem(ARROWS, Reading.HEAD, frozenset({Reading.DONE}))
    conn = connection()
    with pytest.raises(IllegalArrow, match="HEAD -> BODY"):
        conn.receive(request(b"{}"), 101.0)


# -- arrow by arrow -------------------------------------------------------------------------------
def test_head_to_body_starts_the_body_clock():
    conn = connection()
    assert conn.receive(request(b"{}")[:-2], 101.0) == [(Do.TRUST, None)]
    assert conn.state is Reading.BODY
    assert conn.deadline == 101.0 + 20


def test_body_to_idle_forwards_the_request_and_stops_the_clock_while_it_is_answered():
    conn = connection()
    actions = conn.receive(request(b'{"a": 1}'), 101.0)
    assert kinds(actions) == [Do.TRUST, Do.FORWARD]
    ex = actions[1][1]
    assert (ex.method, ex.path, bytes(ex.body)) == ("POST", "/v1/completions", b'{"a": 1}')
    assert conn.state is Reading.IDLE and conn.deadline is None
    assert conn.expire(10_000.0) == []  # no clock while a request is being answered


def test_an_answer_starts_the_idle_clock_and_reads_on():
    conn = connection()
    ex = conn.receive(request(b"{}"), 101.0)[1][1]
    assert conn.answered(ex, 200, 150.0) == [(Do.RESUME_READING, None)]
    assert conn.state is Reading.IDLE and conn.deadline == 150.0 + 30
    assert conn.held == 0 and not conn.queue


def test_idle_to_head_on_the_next_request_byte():
    conn = connection()
    ex = conn.receive(request(b"{}"), 101.0)[1][1]
    conn.answered(ex, 200, 102.0)
    assert conn.receive(b"P", 103.0) == []
    assert conn.state is Reading.HEAD and conn.deadline == 103.0 + 10


def test_head_to_done_a_silent_new_connection_is_closed_quietly_at_its_deadline():
    conn = connection(now=100.0)
    assert conn.expire(109.99) == []
    assert conn.expire(110.0) == [(Do.CLOSE, None)]
    assert conn.state is Reading.DONE and conn.closing


def test_head_to_done_a_head_not_whole_in_time_is_answered_408():
    conn = connection(now=100.0)
    conn.receive(b"POST /v1/completions HTTP/1.1\r\nHo", 105.0)
    assert conn.deadline == 110.0  # the head's clock runs from the connection's first byte
    actions = conn.expire(110.0)
    assert kinds(actions) == [Do.WRITE, Do.RESUME_READING, Do.LINGER]
    assert status_of(written(actions)) == 408 and conn.state is Reading.DONE


def test_body_to_done_a_stalled_body_is_answered_408_and_each_read_restarts_its_clock():
    conn = connection()
    conn.receive(request(b"0123456789")[:-8], 101.0)
    conn.receive(b"2345", 115.0)
    assert conn.expire(121.0) == []  # moved on at 115
    actions = conn.expire(135.0)
    assert status_of(written(actions)) == 408 and b"stalled" in written(actions)
    assert conn.state is Reading.DONE


def test_idle_to_done_a_kept_alive_connection_is_closed_after_the_idle_timeout():
    conn = connection()
    ex = conn.receive(request(b"{}"), 101.0)[1][1]
    conn.answered(ex, 200, 102.0)
    assert conn.expire(131.9) == []
    assert conn.expire(132.0) == [(Do.CLOSE, None)]
    assert conn.state is Reading.DONE


def test_body_to_done_a_body_above_the_limit_is_answered_413():
    conn = connection()
    actions = conn.receive(request(b"x" * (LIMIT + 1)), 101.0)
    assert status_of(written(actions)) == 413 and conn.state is Reading.DONE
    assert Do.FORWARD not in kinds(actions)


def test_head_to_done_bad_bytes_are_answered_400_and_what_follows_is_dropped_up_to_the_limit():
    conn = connection()
    actions = conn.receive(b"NOT HTTP AT ALL\r\n\r\n", 101.0)
    assert status_of(written(actions)) == 400 and kinds(actions)[-1] is Do.LINGER
    assert conn.receive(b"x" * LIMIT, 102.0) == []  # lingering: read and dropped
    assert conn.receive(b"x", 102.0) == [(Do.PAUSE_READING, None)]  # a body's worth at most


def test_a_request_without_the_token_is_answered_401_and_nothing_more_is_parsed():
    conn = connection()
    actions = conn.receive(request(b"{}", auth="") + request(b"{}"), 101.0)
    assert status_of(written(actions)) == 401 and Do.TRUST not in kinds(actions)
    assert Do.FORWARD not in kinds(actions) and conn.state is Reading.DONE


def test_an_upgrade_is_answered_as_any_request_and_ends_the_connection():
    conn = connection()
    actions = conn.receive(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + AUTH.encode()
                           + b"Connection: upgrade\r\nUpgrade: websocket\r\n\r\n", 101.0)
    ex = actions[-1][1]
    assert kinds(actions) == [Do.TRUST, Do.FORWARD] and not ex.keep_alive
    assert conn.state is Reading.DONE
    assert conn.answered(ex, 200, 102.0) == [(Do.CLOSE, None)]


def test_expect_100_continue_is_answered_before_the_body_only_when_it_is_wanted():
    conn = connection()
    head = request(b"0123", extra="Expect: 100-continue\r\n")[:-4]
    assert conn.receive(head, 101.0) == [(Do.TRUST, None), (Do.WRITE, b"HTTP/1.1 100 Continue\r\n\r\n")]
    refused = connection()
    actions = refused.receive(request(b"0123", path="/pause", extra="Expect: 100-continue\r\n")[:-4], 101.0)
    assert status_of(written(actions)) == 404 and b"100 Continue" not in written(actions)


def test_requests_are_answered_in_order_and_reading_ahead_stops_at_the_pipeline_bound():
    conn = connection()
    actions = []
    for _ in range(PIPELINE_MAX + 5):  # one read each (a read is parsed in FEED_BYTES pieces, the bound between)
        actions += conn.receive(request(b"{}"), 101.0)
    assert len([arg for do, arg in actions if do is Do.FORWARD]) == 1  # one at a time
    assert kinds(actions).count(Do.PAUSE_READING) >= 1 and conn.stash is not None
    assert len(conn.queue) == PIPELINE_MAX + 1
    answered = []
    while conn.queue:
        answered.append(conn.queue[0])
        actions = conn.answered(conn.queue[0], 200, 102.0)
    assert len(answered) == PIPELINE_MAX + 5 and conn.held == 0 and conn.stash is None
    assert kinds(actions)[-1] is Do.RESUME_READING


def test_reading_ahead_stops_at_the_byte_bound():
    conn = connection()
    actions = conn.receive(request(b"x" * 3000) * 4, 101.0)
    assert kinds(actions)[-1] is Do.PAUSE_READING and conn.stash is not None
    assert len(conn.queue) == 2 and conn.held > LIMIT


def test_no_new_answer_starts_while_the_client_does_not_take_the_last_one():
    conn = connection()
    first = conn.receive(request(b"{}") * 2, 101.0)[1][1]
    conn.writing_paused()
    assert conn.answered(first, 200, 102.0) == []  # the second waits
    actions = conn.writing_resumed(103.0)
    assert kinds(actions) == [Do.FORWARD] and actions[0][1] is conn.queue[0]


def test_a_refusal_after_pipelined_requests_comes_after_their_answers():
    conn = connection()
    actions = conn.receive(request(b"{}") + b"garbage\r\n\r\n", 101.0)
    assert kinds(actions) == [Do.TRUST, Do.FORWARD, Do.PAUSE_READING]  # the 400 waits its turn
    actions = conn.answered(actions[1][1], 200, 102.0)
    assert status_of(written(actions)) == 400 and kinds(actions)[-1] is Do.LINGER


def test_an_answer_error_after_the_socket_closed_writes_nothing():
    conn = connection()
    ex = conn.receive(request(b"{}"), 101.0)[1][1]
    conn.closing = True
    assert conn.answer_error(ex, 502, "upstream", "gone", (), 102.0) == []


def test_a_lost_connection_abandons_every_request_it_asked():
    conn = connection()
    conn.receive(request(b"{}") * 3, 101.0)
    queued = list(conn.queue)
    assert conn.lost() == [(Do.ABANDON, ex) for ex in queued]
    assert conn.state is Reading.DONE and conn.deadline is None and conn.expire(1e9) == []


def test_the_request_sent_on_has_no_token_no_per_connection_headers_and_its_own_framing():
    conn = connection()
    ex: Exchange = conn.receive(request(b"{}", extra="Connection: x-hop\r\nX-Hop: 1\r\nX-Keep: 2\r\n"), 101.0)[1][1]
    sent = ex.request_bytes(b"localhost", frozenset({b"x-hop"}))
    assert sent == b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nX-Keep: 2\r\nContent-Length: 2\r\n\r\n{}"


# -- fuzz -----------------------------------------------------------------------------------------
ROUTES = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/inference/v1/generate"]
bodies = st.binary(max_size=300)
valid = st.lists(st.tuples(st.sampled_from(ROUTES), bodies, st.booleans()), min_size=1, max_size=8)


def chunked(body: bytes, path: str) -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\n{AUTH}Transfer-Encoding: chunked\r\n\r\n".encode()
    return head + (b"%x\r\n%s\r\n" % (len(body), body) if body else b"") + b"0\r\n\r\n"


class Driver:
    """Plays the socket and the server: feeds what the client sent while reading is not paused,
    answers what is forwarded, checks what the connection asks for."""

    def __init__(self, conn: Connection):
        self.conn, self.now = conn, 100.0
        self.forwarded: list[Exchange] = []
        self.written = b""
        self.paused = self.closed = False

    def do(self, actions) -> None:
        for do, arg in actions:
            assert not self.closed, f"{do} after the connection was closed"
            if do is Do.WRITE:
                self.written += arg
            elif do is Do.FORWARD:
                assert arg is self.conn.queue[0] and arg not in self.forwarded
                self.forwarded.append(arg)
            elif do is Do.PAUSE_READING:
                self.paused = True
            elif do is Do.RESUME_READING:
                self.paused = False
            elif do is Do.CLOSE:
                self.closed = True
        conn = self.conn
        assert conn.held >= 0 and len(conn.queue) <= PIPELINE_MAX + 1
        assert (conn.deadline is None) == bool(conn.queue or conn.state is Reading.DONE or conn.closing) \
            or conn.closing, (conn.state, conn.deadline, len(conn.queue))

    def answer(self) -> None:
        if self.forwarded and self.conn.queue and self.forwarded[-1] is self.conn.queue[0]:
            self.do(self.conn.answered(self.forwarded[-1], 200, self.now))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid, st.data())
def test_any_split_of_valid_requests_forwards_the_same_requests_in_order(reqs, data):
    stream = b"".join(chunked(body, path) if is_chunked else request(body, path) for path, body, is_chunked in reqs)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=12)))
    pieces = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    driver = Driver(connection())
    pending = b""
    for piece in pieces:
        pending += piece
        if data.draw(st.booleans()):
            driver.answer()
        if not driver.paused and pending:
            driver.do(driver.conn.receive(pending, driver.now))
            pending = b""
    for _ in range(len(reqs) + 1):
        driver.answer()
        if not driver.paused and pending:
            driver.do(driver.conn.receive(pending, driver.now))
            pending = b""
    assert [(ex.path, bytes(ex.body)) for ex in driver.forwarded] == [(p, b) for p, b, _ in reqs]
    assert driver.written == b"" and not driver.closed and driver.conn.state is Reading.IDLE
    assert driver.conn.held == 0 and driver.conn.deadline == driver.now + 30


pieces = st.sampled_from([request(b"{}"), chunked(b"ab", "/tokenize"), b"\r\n", b"0\r\n\r\n", request(b"{}", auth="")])
events = st.one_of(
    st.tuples(st.just("bytes"), st.one_of(st.binary(max_size=200), pieces)),
    st.tuples(st.just("time"), st.floats(0, 40)),
    st.tuples(st.just("answer"), st.sampled_from([200, 404, 502])),
    st.tuples(st.just("error"), st.just(503)),
    st.tuples(st.just("pause"), st.none()),
    st.tuples(st.just("resume"), st.none()),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(events, max_size=30), st.booleans())
def test_random_bytes_and_events_never_break_the_connection(script, lose):
    driver = Driver(connection())
    conn = driver.conn
    for kind, arg in script:
        if driver.closed:
            break
        if kind == "bytes" and not driver.paused:
            driver.do(conn.receive(arg, driver.now))
        elif kind == "time":
            driver.now += arg
            driver.do(conn.expire(driver.now))
        elif kind == "answer":
            driver.answer()
        elif kind == "error" and driver.forwarded and conn.queue and driver.forwarded[-1] is conn.queue[0]:
            driver.do(conn.answer_error(conn.queue[0], 503, "unavailable", "paused", (), driver.now))
        elif kind == "pause":
            driver.do(conn.writing_paused())
        elif kind == "resume":
            driver.do(conn.writing_resumed(driver.now))
    if driver.written:  # every answer of the connection's own is a whole HTTP answer, in order
        assert driver.written.startswith(b"HTTP/1.1 ")
    if lose:
        queued = list(conn.queue)
        assert conn.lost() == [(Do.ABANDON, ex) for ex in queued]
        assert conn.state is Reading.DONE
