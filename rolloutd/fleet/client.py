"""The trainer's generation client: one call generates on the fleet, under a version contract.

:class:`Fleet` finds the replicas in the registry's directory (refreshed every ``refresh_s``
on its own task), routes each request (:mod:`rolloutd.fleet.router`), and sends it to the
replica's gateway as vLLM's token-in/token-out request (``POST /inference/v1/generate``).

One request goes through these steps (:class:`Step`), each bounded by the request's deadline:

- ROUTE: wait for a replica that is serving, heard from lately, not avoided and at the
  request's version (``min_version``, or ``max_lag`` behind the registry's newest), at most
  ``wait_s``; :class:`~rolloutd.fleet.errors.NoReplica` then.
- SEND: the request, with its token budget clamped to the replica's ``max_model_len`` (read
  from its ``/v1/models`` once per server process) and ``X-Rolloutd-Min-Version``, so the
  gateway refuses it if the server is below the version after all.
- An answer ends it, unless the server ended it early to load new weights
  (``finish_reason: "abort"``): then CONTINUE: the prompt plus the tokens so far are sent
  again, the budget re-clamped, on whichever replica qualifies; the result's
  ``weight_versions`` then show both versions.
- A failure RETRYs on another replica: ``503``/``429`` (its ``Retry-After`` is how long the
  replica is avoided), ``409 version_behind``, a connection refused, a server that died
  mid-request (the connection closed without an answer), any other ``5xx``, an answer below
  the request's version or not the generate route's shape. After ``max_attempts`` failures:
  :class:`~rolloutd.fleet.errors.RetriesExhausted`. The caller gets one answer or one error,
  never two answers.
- A ``4xx`` that another server would give too (malformed, unknown route, no token) is raised
  at once (:class:`~rolloutd.fleet.errors.Rejected`).

Cancelling the call aborts the request: its connection closes, the gateway closes its
connection to vLLM, and vLLM stops generating it.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from rolloutd.fleet.directory import Directory, Replica
from rolloutd.fleet.errors import (
    FleetError,
    GenerationTimeout,
    NoReplica,
    PromptTooLong,
    Rejected,
    RetriesExhausted,
    Unauthorized,
    VersionRefused,
)
from rolloutd.fleet.result import BadAnswer, Generation, Part, parse_part
from rolloutd.fleet.router import Router
from rolloutd.fleet.sampling import Sampling
from rolloutd.wire import version_contract as contract

log = logging.getLogger("rolloutd.fleet")

GENERATE = "/inference/v1/generate"
MODELS = "/v1/models"
ROUTE_POLL_S = 0.1  # how often a request waiting for a replica looks again (a new listing wakes it sooner)


class Step(enum.Enum):
    ROUTE = "route"  # waiting for a replica that meets the request
    SEND = "send"  # in flight to a replica
    CONTINUE = "continue"  # a server ended it early (an abort-mode update): resubmitted with its tokens
    RETRY = "retry"  # the attempt failed: on to another replica
    DONE = "done"


@dataclass(frozen=True)
class _Failure:
    """A failed attempt that another replica may get right."""

    why: str
    kind: str  # a stats key: unavailable, behind, connect, lost, server_error, bad_answer, timeout
    avoid_s: float | None  # how long to avoid the replica (None: the growing default; 0: not at all)


class Fleet:
    """Generation on the fleet of one registry. ``async with Fleet(url) as fleet: await fleet.generate(...)``.

    ``registry_token``: the registry's bearer token (for its directory); ``gateway_token``: the
    servers' gateway token. ``max_age_s``: a replica not heard from for this long is left out.
    ``avoid_initial_s`` .. ``avoid_max_s``: how long a failed replica is avoided, doubling with
    each failure in a row. ``timeout_s``: a request's whole time, every attempt included;
    ``wait_s``: the longest a request waits for a replica that meets it.
    """

    def __init__(self, registry_url: str, *, registry_token: str | None = None, gateway_token: str | None = None,
                 refresh_s: float = 2.0, max_age_s: float = 15.0, max_attempts: int = 4,
                 avoid_initial_s: float = 0.5, avoid_max_s: float = 10.0, wait_s: float = 60.0,
                 timeout_s: float = 600.0, connect_timeout_s: float = 5.0, max_connections: int = 1024,
                 keepalive_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        if max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        self.registry_url = registry_url.rstrip("/")
        self.refresh_s, self.max_attempts, self.wait_s, self.timeout_s = refresh_s, max_attempts, wait_s, timeout_s
        self.avoid_initial_s, self.avoid_max_s = avoid_initial_s, avoid_max_s
        self.connect_timeout_s, self.clock = connect_timeout_s, clock
        self._registry_headers = {"Authorization": f"Bearer {registry_token}"} if registry_token else {}
        self._gateway_headers = {"Authorization": f"Bearer {gateway_token}"} if gateway_token else {}
        self._max_connections, self._keepalive_s = max_connections, keepalive_s
        self.directory = Directory(max_age_s, clock)
        self.router = Router(self.directory)
        self.stats: Counter[str] = Counter()
        self._http: aiohttp.ClientSession | None = None
        self._refresher: asyncio.Task | None = None
        self._poke: asyncio.Event | None = None
        self._listed: asyncio.Event | None = None  # set (and replaced) at each new listing
        self._refresh_failing = False

    def __repr__(self) -> str:  # never shows a token
        return f"Fleet({self.registry_url!r})"

    # -- life ------------------------------------------------------------------------------------
    async def start(self) -> Fleet:
        """Read the directory once (FleetError if the registry cannot be read), then keep it fresh."""
        if self._http is not None:
            return self
        connector = aiohttp.TCPConnector(limit=self._max_connections, limit_per_host=0,
                                         keepalive_timeout=self._keepalive_s, enable_cleanup_closed=True)
        self._http = aiohttp.ClientSession(connector=connector, json_serialize=_dumps)
        self._poke, self._listed = asyncio.Event(), asyncio.Event()
        try:
            await self.refresh()
        except FleetError:
            await self.close()
            raise
        self._refresher = asyncio.get_running_loop().create_task(self._refresh_loop(), name="fleet-refresh")
        return self

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
            self._refresher = None
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def __aenter__(self) -> Fleet:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # -- discovery -------------------------------------------------------------------------------
    async def refresh(self) -> None:
        """Read the registry's directory and newest version now; FleetError if it cannot."""
        try:
            listing = await self._registry_get("/v1/replicas")
            latest = await self._registry_get("/v1/versions/latest", missing_ok=True)
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            raise FleetError(f"cannot read the registry's directory at {self.registry_url}: {e!r}") from None
        newest = latest.get("version") if latest else None
        self.directory.apply(listing.get("replicas") or [], newest=newest, instance=listing.get("instance"),
                             newest_digest=latest.get("digest") if latest else None)
        listed, self._listed = self._listed, asyncio.Event()
        listed.set()

    async def _next_listing(self, at_most_s: float) -> None:
        """Ask for a listing now, and wait for it (at most ``at_most_s``)."""
        self._poke.set()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(at_most_s):
                await self._listed.wait()

    async def _registry_get(self, path: str, missing_ok: bool = False) -> dict:
        timeout = aiohttp.ClientTimeout(total=self.connect_timeout_s + 10, connect=self.connect_timeout_s)
        async with self._http.get(self.registry_url + path, headers=self._registry_headers, timeout=timeout) as r:
            if missing_ok and r.status == 404:
                return {}
            if r.status != 200:
                raise ValueError(f"GET {path}: HTTP {r.status}: {(await r.text())[:200]}")
            body = await r.json(content_type=None)
            if not isinstance(body, dict):
                raise ValueError(f"GET {path}: not a JSON object")
            return body

    async def _refresh_loop(self) -> None:
        """Refresh every ``refresh_s``, or at once when a waiting request pokes (at most every
        ``ROUTE_POLL_S * 2``). A registry that cannot be read keeps the last listing: the
        replicas serve on whatever happens to the registry."""
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.refresh_s):
                    await self._poke.wait()
            self._poke.clear()
            try:
                await self.refresh()
            except FleetError as e:
                if not self._refresh_failing:
                    log.warning("refresh: %s (keeping the last listing; retrying every %g s)", e, self.refresh_s)
                self._refresh_failing = True
            except Exception:  # a bug: logged, and the loop goes on
                log.exception("refresh: unexpected error")
            else:
                if self._refresh_failing:
                    log.info("refresh: the registry's directory is readable again")
                self._refresh_failing = False
            await asyncio.sleep(ROUTE_POLL_S * 2)

    @property
    def newest(self) -> int | None:
        """The registry's newest version, as of the last refresh."""
        return self.directory.newest

    def replicas(self) -> list[dict]:
        """What the client knows of each replica: endpoint, state, version, requests in flight, ..."""
        return [r.view() for r in sorted(self.directory.replicas.values(), key=lambda r: r.replica_id)]

    async def wait_for(self, min_version: int, n: int = 1, timeout_s: float = 600.0) -> list[dict]:
        """Wait until ``n`` usable replicas hold ``min_version`` or newer; NoReplica after
        ``timeout_s``, or at once (VersionRefused) when too few can get there: the nodes of the
        others refused the registry's newest version."""
        deadline = self.clock() + timeout_s
        while True:
            ready = self.directory.usable(min_version)
            if len(ready) >= n:
                return [r.view() for r in ready]
            if (stuck := self.directory.refusing(min_version)) and \
                    sum(r.listed for r in self.directory.replicas.values()) - len(stuck) < n:
                reasons = sorted({r.declined[(self.directory.newest, self.directory.newest_digest)] for r in stuck})
                raise VersionRefused(f"{len(stuck)} replica(s) will not reach version {min_version} (for {n} "
                                     f"wanted): their nodes refused version {self.directory.newest} "
                                     f"({'; '.join(reasons)[:500]})", reasons)
            if self.clock() >= deadline:
                raise NoReplica(f"{len(ready)} of {n} replicas at version >= {min_version} after {timeout_s:g} s "
                                f"({self.directory.describe()})")
            await self._next_listing(ROUTE_POLL_S * 2)

    # -- generation ------------------------------------------------------------------------------
    def floor(self, min_version: int | None, max_lag: int | None) -> int | None:
        """The lowest version a request may be answered by: ``min_version``, or ``max_lag``
        behind the registry's newest (the higher of the two when both are given)."""
        floors = [v for v in (min_version, None if max_lag is None or self.newest is None
                              else self.newest - max_lag) if v is not None]
        floor = max(floors) if floors else None
        return floor if floor is not None and floor > 0 else None

    async def generate(self, prompt_ids: Sequence[int], sampling: Sampling | None = None, *,
                       min_version: int | None = None, max_lag: int | None = None, session: str | None = None,
                       timeout_s: float | None = None) -> Generation:
        """Generate from ``prompt_ids`` on one replica (or several, across updates and failures)."""
        if self._http is None:
            raise RuntimeError("the fleet client is not started (use `async with Fleet(...)` or `await start()`)")
        if not prompt_ids:
            raise ValueError("prompt_ids is empty")
        if max_lag is not None and max_lag < 0:
            raise ValueError("max_lag must be >= 0")
        req = _Request(self, list(prompt_ids), sampling or Sampling(), self.floor(min_version, max_lag), session,
                       self.clock() + (self.timeout_s if timeout_s is None else timeout_s))
        self.stats["requests"] += 1
        try:
            gen = await req.run()
        except FleetError as e:
            self.stats[f"error_{type(e).__name__}"] += 1
            raise
        self.stats["answered"] += 1
        return gen

    async def generate_many(self, prompts: Sequence[Sequence[int]], sampling: Sampling | None = None,
                            **contract_kw: Any) -> list[Generation]:
        """``generate`` for each prompt, all at once; the first error cancels the rest and is raised."""
        tasks = [asyncio.ensure_future(self.generate(p, sampling, **contract_kw)) for p in prompts]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    # -- one attempt -----------------------------------------------------------------------------
    async def _max_model_len(self, replica: Replica, deadline: float) -> int | None:
        """The server's ``max_model_len`` from its ``/v1/models`` (once per server process)."""
        if replica.max_model_len is None:
            timeout = aiohttp.ClientTimeout(total=max(0.1, min(deadline - self.clock(), 30.0)),
                                            connect=self.connect_timeout_s)
            async with self._http.get(replica.endpoint + MODELS, headers=self._gateway_headers,
                                      timeout=timeout) as r:
                if r.status != 200:
                    return None  # the generate request itself will say what is wrong
                try:
                    body = await r.json(content_type=None)
                except ValueError:
                    return None
            with contextlib.suppress(KeyError, IndexError, TypeError, ValueError):
                replica.max_model_len = int(body["data"][0]["max_model_len"])
        return replica.max_model_len

    async def _post(self, replica: Replica, body: dict, top_k: int, floor: int | None,
                    deadline: float) -> Part | _Failure:
        headers = dict(self._gateway_headers)
        if floor is not None:
            headers[contract.MIN_VERSION_HEADER] = str(floor)
        timeout = aiohttp.ClientTimeout(total=max(0.1, deadline - self.clock()), connect=self.connect_timeout_s)
        async with self._http.post(replica.endpoint + GENERATE, json=body, headers=headers, timeout=timeout) as r:
            if r.status == 200:
                try:
                    return parse_part(await r.json(content_type=None), top_k)
                except (BadAnswer, ValueError) as e:
                    return _Failure(f"answer not understood: {e}", "bad_answer", None)
            return await self._refusal(replica, r)

    async def _refusal(self, replica: Replica, r: aiohttp.ClientResponse) -> _Failure:
        """What a non-200 answer means: a retryable failure, or an error raised at once."""
        text = (await r.text())[:500]
        code, message = _error_of(text)
        said = f"HTTP {r.status}" + (f" {code}" if code else "") + (f": {message}" if message else "")
        if r.status == contract.BEHIND_STATUS and code == contract.BEHIND_CODE:
            replica.refused_at(contract.parse_held(r.headers.get(contract.VERSION_HEADER)))
            return _Failure(said, "behind", 0)
        if r.status in (429, 503):
            return _Failure(said, "unavailable", _retry_after(r.headers.get("Retry-After"), self.avoid_max_s))
        if r.status in (401, 403):
            raise Unauthorized(f"{replica.replica_id}: {said}", status=r.status, code=code, replica=replica.replica_id)
        if r.status == 408 or r.status >= 500:
            return _Failure(said, "server_error", None)
        raise Rejected(f"{replica.replica_id}: {said}", status=r.status, code=code, replica=replica.replica_id)

    def _avoid(self, replica: Replica, avoid_s: float | None) -> None:
        if avoid_s == 0:
            return
        if avoid_s is None:
            avoid_s = min(self.avoid_initial_s * 2 ** replica.failures, self.avoid_max_s)
        replica.failed(self.clock(), avoid_s)


class _Request:
    """One generation request, from routing to its answer (the steps of the module's docstring)."""

    def __init__(self, fleet: Fleet, prompt: list[int], sampling: Sampling, floor: int | None,
                 session: str | None, deadline: float):
        self.fleet, self.sampling, self.floor, self.session, self.deadline = fleet, sampling, floor, session, deadline
        self.gen = Generation(prompt)
        self.failures: list[tuple[str, str]] = []
        self.idle_parts = 0  # parts that ended early without a single token, in a row
        self.step = Step.ROUTE

    async def run(self) -> Generation:
        while True:
            replica = await self._route()
            self.step = Step.SEND
            outcome = await self._attempt(replica)
            if outcome is None:  # continued up to the model's length: nothing is left to generate
                self.gen.finish_reason, self.step = "length", Step.DONE
                return self.gen
            self.gen.attempts += 1
            if isinstance(outcome, _Failure):
                self._retry(replica, outcome)
            elif self._finished(replica, outcome):
                self.step = Step.DONE
                return self.gen

    async def _route(self) -> Replica:
        fleet, waited_since = self.fleet, self.fleet.clock()
        tried = frozenset(rid for rid, _ in self.failures)
        while True:
            replica = fleet.router.pick(self.floor, self.session, tried)
            if replica is not None:
                return replica
            now = fleet.clock()
            if now >= self.deadline:
                raise GenerationTimeout(self._why("timed out waiting for a replica"))
            if now - waited_since >= fleet.wait_s:
                raise NoReplica(self._why(f"no replica within {fleet.wait_s:g} s"))
            self.step = Step.ROUTE
            await fleet._next_listing(ROUTE_POLL_S)  # or an avoided replica's time is up

    def _why(self, what: str) -> str:
        want = f" at version >= {self.floor}" if self.floor is not None else ""
        return f"{what}{want} ({self.fleet.directory.describe()})"

    async def _attempt(self, replica: Replica) -> Part | _Failure | None:
        """One request to ``replica``: its answer, or why it failed; None when the tokens so far
        already fill the server's ``max_model_len``."""
        fleet, gen = self.fleet, self.gen
        replica.in_flight += 1
        try:
            mml = await fleet._max_model_len(replica, self.deadline)
            tokens = gen.prompt_ids + gen.token_ids
            left = self.sampling.max_tokens - len(gen.token_ids)
            room = left if mml is None else min(left, mml - len(tokens))
            if room <= 0 and gen.token_ids:
                return None
            if room <= 0:
                raise PromptTooLong(f"{len(tokens)} tokens leave no room under {replica.replica_id}'s max_model_len "
                                    f"{mml}", replica=replica.replica_id)
            body = {"token_ids": tokens, "sampling_params": self.sampling.params(room), "stream": False}
            outcome = await fleet._post(replica, body, self.sampling.top_logprobs, self.floor, self.deadline)
        except aiohttp.ClientConnectorError as e:
            outcome = _Failure(f"cannot connect: {e.os_error or e}", "connect", None)
        except aiohttp.ClientError as e:  # the server closed or reset the connection before its answer's end
            outcome = _Failure(f"connection lost mid-request: {type(e).__name__}", "lost", None)
        except TimeoutError:
            if fleet.clock() >= self.deadline:
                raise GenerationTimeout(f"no answer within the request's timeout (last tried: "
                                        f"{replica.replica_id})") from None
            outcome = _Failure("timed out", "timeout", None)
        finally:
            replica.in_flight -= 1
        if isinstance(outcome, Part):
            outcome = self._check_contract(replica, outcome)
        return outcome

    def _check_contract(self, replica: Replica, part: Part) -> Part | _Failure:
        """The gateway refuses a request below its version; this catches a server that
        answered from older weights anyway (a gateway without the check): never passed on."""
        versions = [s.version for s in part.spans]
        if self.floor is not None and versions and (None in versions or min(versions) < self.floor):
            held = min((v for v in versions if v is not None), default=None)
            replica.refused_at(held)
            return _Failure(f"answered by version {held} below {self.floor}", "behind", 0)
        replica.answered(max((v for v in versions if v is not None), default=None))
        return part

    def _retry(self, replica: Replica, failure: _Failure) -> None:
        fleet = self.fleet
        self.step = Step.RETRY
        self.failures.append((replica.replica_id, failure.why))
        fleet.stats[f"retry_{failure.kind}"] += 1
        fleet._avoid(replica, failure.avoid_s)
        if len(self.failures) >= fleet.max_attempts:
            tried = "; ".join(f"{rid}: {why}" for rid, why in self.failures)
            raise RetriesExhausted(f"{len(self.failures)} attempts failed: {tried}", list(self.failures))
        log.info("retry %s: %s (attempt %d of %d)", replica.replica_id, failure.why, len(self.failures),
                 fleet.max_attempts)

    def _finished(self, replica: Replica, part: Part) -> bool:
        """Take an answer; False when the request goes on (a server ended it early)."""
        gen, fleet = self.gen, self.fleet
        if part.token_ids or not gen.replicas:
            gen.add(part, replica.replica_id)
        else:
            gen.finish_reason = part.finish_reason
        fleet.router.stick(self.session, replica)
        if part.finish_reason != "abort":
            return True
        if len(gen.token_ids) >= self.sampling.max_tokens:
            gen.finish_reason = "length"
            return True
        self.idle_parts = 0 if part.token_ids else self.idle_parts + 1
        if self.idle_parts >= fleet.max_attempts:
            raise RetriesExhausted(f"ended early without a token {self.idle_parts} times in a row",
                                   [(replica.replica_id, "aborted")] * self.idle_parts)
        self.step = Step.CONTINUE
        fleet.stats["continued"] += 1
        log.info("continue %s: ended early after %d tokens (a server paused for an update); resubmitting",
                 replica.replica_id, len(gen.token_ids))
        return False


def _error_of(text: str) -> tuple[str | None, str | None]:
    """(code, message) of an error body: rolloutd's ``{"error": {"code", "message"}}`` or vLLM's."""
    try:
        body = json.loads(text)
    except ValueError:
        return None, text.strip()[:200] or None
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        return (str(err["code"]) if isinstance(err.get("code"), str) else None), str(err.get("message") or "")[:300]
    if isinstance(body, dict) and "detail" in body:
        return None, str(body["detail"])[:300]
    return None, text.strip()[:200] or None


def _retry_after(value: str | None, cap_s: float) -> float | None:
    try:
        return min(max(float(value), 0.05), cap_s) if value is not None else None
    except ValueError:
        return None


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))
