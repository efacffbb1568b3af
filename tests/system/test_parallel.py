"""Servers of several processes through the daemon: a real CPU ``vllm serve`` with the plugin,
tensor-parallel (``--tensor-parallel-size 2``) beside a one-worker server of the same model, then
data-parallel (``--data-parallel-size 2``: two engines, two API server processes on one UNIX
socket); docs/parallel.md.

One daemon at a time, shared by the tests of its shape, which run in file order: the tied
family updated A -> B -> C, each version's greedy outputs through every gateway equal to
transformers'; for DP, the prompts sent to each engine in turn (vLLM's header
``X-data-parallel-rank``; vLLM counts the requests of each engine in ``/metrics``, which shows the
header did pin them), so an engine left on old weights cannot hide. Then one TP worker, or one DP
engine, killed in the middle of an update (the server then serves the new version exactly); then
an update in each pause mode (abort, wait, keep) under load; for DP, last, an engine killed while
serving, and the node stopped while the server starts again.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from rolloutd.demo import families
from tests.support import served
from tests.support.daemon_harness import vllm_server, wait_until
from tests.support.processes import group_pids
from tests.support.served import NEW_TOKENS, RANK_HEADER, OneAtATime, generate
from tests.support.vllm_server import require_vllm, shm_mapped

# alone: its servers take both cores, a rank on each, and each rank waits spinning for the
# other; beside another file, both took two to three times as long (the soak beside it: 750 s
# instead of 393).
pytestmark = [pytest.mark.timeout(900), pytest.mark.usefixtures("one_torch_thread"), pytest.mark.alone]

FAMILY = "qwen2"  # tied embeddings: the output head must follow the embedding on every worker
SEED = {v: 10 + v for v in range(1, 7)}  # version -> weights seed; the servers start on seed 0 (A)
TP, ONE, DP = "tp2", "tp1", "dp2"
ENGINES = {DP: 2}  # data-parallel engines per server (others: one)


class Node(served.Node):
    """A daemon of the parallel servers of one kind, started on A, every server SERVING;
    ``gateways``: server -> its gateway; ``paused_s``: server -> version -> its pause."""

    KINDS = {  # each server lists its cores; the daemon splits them between its workers
        "tp": lambda: [vllm_server(TP, Path(), "0-1", args=["--tensor-parallel-size", "2"], env={}),
                       vllm_server(ONE, Path(), "1")],  # shares core 1 with the second TP worker
        "dp": lambda: [vllm_server(DP, Path(), "0-1", args=["--data-parallel-size", "2"], env={})],
    }

    def __init__(self, tmp: Path, kind: str):
        self.tmp = tmp
        start = families.build(tmp / "A", FAMILY, seed=0)
        servers = [{**s, "model": str(start)} for s in self.KINDS[kind]()]
        # The pull at the daemon's priority: on 2 cores the engines, their spinning workers and the
        # load keep both busy, and a pull worker at the default nice 10 waited 68 s for a CPU in
        # a minute (1.4 MiB in 1.6-10.8 s; once over 120 s). This file checks the updates, not
        # the pull's priority (bench/README.md, "A pull on a node whose CPUs are all busy").
        super().__init__(tmp, servers, restart={"start_timeout_s": 400, "failed_grace_s": 2, "backoff_initial_s": 0.5,
                                                "backoff_max_s": 2, "max_retries": 3},
                         pull={"cpu_priority": "normal"})
        try:
            st = self.serving(600)
        except BaseException:
            self.kill()
            raise
        print(f"{', '.join(s['name'] for s in servers)} SERVING {time.monotonic() - self.t0:.1f} s after the "
              "daemon's start")
        self.gateways = {x["name"]: self.gateway(x["name"], st) for x in st["servers"]}
        self.paused_s: dict[str, dict[int, float]] = {s["name"]: {} for s in servers}

    def ranks(self, name: str) -> list[int | None]:
        """The engines of server ``name`` to ask in turn (None: the server's only one)."""
        return list(range(ENGINES[name])) if name in ENGINES else [None]

    @property
    def scratch(self) -> list[Path]:
        """The servers' own directories (each one's TMPDIR), gone once its processes are."""
        d = self.tmp / "state" / "scratch"
        return sorted(d.iterdir()) if d.exists() else []

    def close(self) -> None:
        super().close()
        assert self.scratch == [], "a stopped server's TMPDIR is left"


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    """One node at a time: two would only take each other's cores."""
    require_vllm()
    n = OneAtATime(lambda kind: Node(tmp_path_factory.mktemp(kind), kind))
    yield n
    n.close()


def served_exactly(node: Node, version: int, want: list[list[int]]) -> None:
    """Every server of ``node`` serves ``version``, each of its engines as transformers. The
    prompts include one longer than a KV-cache block, sent to each engine on the version before:
    a prefix-cache block of older weights left in any engine changes its answer."""
    st = node.daemon.wait_versions({name: version for name in node.gateways}, 300)
    for name, url in node.gateways.items():
        for rank in node.ranks(name):
            before = engine_answers(node, name) if rank is not None else {}
            got, labels = generate(url, families.PROMPTS, rank)
            where = name if rank is None else f"{name} engine {rank}"
            assert labels == {str(version)}, (where, labels)
            assert got == want, f"{where} on version {version}: served {got}, transformers {want}"
            if rank is not None:  # the header pinned them: that engine answered them all, no other one
                answered_only_by(node, name, rank, before, len(families.PROMPTS))
        node.paused_s[name][version] = node.daemon.server(name, st)["last_update"]["phases_s"]["paused"]


def answered_only_by(node: Node, name: str, rank: int, before: dict[str, float], n: int) -> None:
    """vLLM counted ``n`` answers of engine ``rank`` of server ``name`` since ``before``, none of another."""
    want = {e: n if e == str(rank) else 0 for e in map(str, node.ranks(name))}
    seen: list[dict[str, float]] = []

    def counted() -> bool:
        after = engine_answers(node, name)
        seen.append({e: after.get(e, 0) - before.get(e, 0) for e in want})
        return seen[-1] == want
    try:
        wait_until(counted, 10, f"engine {rank} of {name} counted alone")
    except AssertionError:
        raise AssertionError(f"answers counted by the engines of {name}: {seen[-1]}, not {want}") from None


def a_to_c(node: Node) -> None:
    """A, then B and C published: each served exactly by every server of ``node``."""
    a = families.greedy(families.hf_model(FAMILY, 0), families.PROMPTS, NEW_TOKENS)
    for name, url in node.gateways.items():
        for rank in node.ranks(name):
            assert generate(url, families.PROMPTS, rank)[0] == a, f"{name} {rank}: the start model differs"
    for version in (1, 2):  # B, C
        model = families.hf_model(FAMILY, SEED[version])
        want = families.greedy(model, families.PROMPTS, NEW_TOKENS)
        assert all(x != y for x, y in zip(a, want, strict=True)), "every output must change"
        node.reg.publish(version, model)
        served_exactly(node, version, want)
    print("pause window (s) per version:", {k: {v: round(s, 3) for v, s in d.items()} for k, d in
                                              node.paused_s.items()})


def test_a_tensor_parallel_server_is_updated_a_b_c_exactly(nodes):
    """Both workers load every version: a worker left on old weights (or an output head left on
    the old embedding) changes the greedy tokens."""
    node = nodes.get("tp")
    with node.daemon.vllm(TP) as c:
        assert c.get("/get_world_size").json()["world_size"] == 2
    log = node.daemon.log_text()
    assert "VLLM_CPU_OMP_THREADS_BIND='0|1'" in log and "local_rank=1, core ids=[1]" in log, log[-3000:]
    environ = Path(f"/proc/{node.daemon.server(TP)['pid']}/environ").read_text()
    [tmp] = [p for p in node.scratch if f"TMPDIR={p}\0" in environ]  # its own, not /tmp
    assert [f.name for f in tmp.iterdir() if f.name.startswith("vllm_dist_")], "vLLM's rendezvous store"
    a_to_c(node)


def _process(pgid: int, title: str) -> int:
    """The process of group ``pgid`` that vLLM titled ``VLLM::<title>``."""
    for pid in group_pids(pgid):
        try:
            if f"VLLM::{title}" in Path(f"/proc/{pid}/cmdline").read_text():
                return pid
        except OSError:
            continue
    raise AssertionError(f"no {title} in group {pgid}")


def killed_mid_update(node: Node, server: str, title: str) -> None:
    """The process ``title`` of ``server`` is stopped before an update (the update's first route
    that needs it then waits), then killed once the daemon is UPDATING: the server is in BACKOFF
    within seconds, then SERVING the new version exactly; nothing of the old group is left:
    processes, /dev/shm segments, its TMPDIR."""
    d = node.daemon
    pid = d.server(server)["pid"]
    segments, old_tmp = held(node, pid)
    assert any(old_tmp.iterdir()), "vLLM wrote nothing in its TMPDIR"
    victim = _process(pid, title)
    os.kill(victim, signal.SIGSTOP)
    model = families.hf_model(FAMILY, SEED[3])
    want = families.greedy(model, families.PROMPTS, NEW_TOKENS)
    node.reg.publish(3, model)
    d.wait(lambda s: d.server(server, s)["state"] == "UPDATING", 120, "UPDATING")
    time.sleep(1.0)  # a route of the update is in flight, held by the stopped process
    assert d.server(server)["state"] == "UPDATING"
    t0 = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    d.wait(lambda s: d.server(server, s)["state"] == "BACKOFF", 30, "BACKOFF")
    to_backoff = time.monotonic() - t0
    group_gone(node, pid, segments, old_tmp)
    served_exactly(node, 3, want)
    print(f"{title} killed: BACKOFF after {to_backoff:.1f} s, SERVING v3 after {time.monotonic() - t0:.1f} s; "
          f"segments of the old group: {sorted(segments)}")
    assert to_backoff < 10, to_backoff
    assert d.server(server)["incarnation"] == 2


def held(node: Node, pid: int) -> tuple[set[str], Path]:
    """What the server group of ``pid`` holds: its /dev/shm segments (some), its TMPDIR (one of
    the node's scratch directories)."""
    segments = {n for n in shm_mapped(group_pids(pid)) if "/" not in n}
    assert segments, "the group holds no /dev/shm segment"
    environ = Path(f"/proc/{pid}/environ").read_text()
    [tmp] = [p for p in node.scratch if f"TMPDIR={p}\0" in environ]
    return segments, tmp


def group_gone(node: Node, pid: int, segments: set[str], tmp: Path) -> None:
    """Nothing of the group of ``pid`` left: its processes, its /dev/shm ``segments`` and its
    ``tmp`` (TMPDIR), removed by the daemon once it found the group gone."""
    wait_until(lambda: not group_pids(pid), 30, "the old group gone")
    left = lambda: sorted(n for n in segments if (Path("/dev/shm") / n).exists())  # noqa: E731
    wait_until(lambda: not left(), 30, f"the dead group's shared memory removed (of {sorted(segments)})")
    wait_until(lambda: tmp not in node.scratch, 30, "the TMPDIR of the killed group removed")


def test_a_tp_worker_killed_mid_update_is_in_backoff_within_seconds(nodes):
    killed_mid_update(nodes.get("tp"), TP, "Worker_TP1")


# -- every pause mode, under load ----------------------------------------------------------------------
MODES = {4: "abort", 5: "wait", 6: "keep"}  # version -> update.pause_mode it is loaded with
LOAD_TOKENS = 48  # per request of the load: long enough that some are in flight when the server pauses
CHECKED = NEW_TOKENS  # tokens of each version's part compared with transformers' (further on, a near tie may part them)


class Load(threading.Thread):
    """Greedy requests through a gateway, one after another (engine ``rank`` of a DP server),
    until stopped: (prompt, HTTP status, the answer's choice or the error)."""

    def __init__(self, url: str, rank: int | None):
        super().__init__(daemon=True)
        self.url, self.rank, self.stopped, self.answers = url, rank, threading.Event(), []

    def answered_on(self, version: int) -> bool:
        """Some request of the load was answered (its end) by ``version``."""
        return any(status == 200 and choice["weight_versions"] and
                   choice["weight_versions"][-1]["version"] == str(version)
                   for _, status, choice in list(self.answers))

    def stop(self) -> None:
        self.stopped.set()
        self.join(150)
        assert not self.is_alive(), "a request of the load was never answered"

    def run(self) -> None:
        headers = {RANK_HEADER: str(self.rank)} if self.rank is not None else {}
        with httpx.Client(base_url=self.url, timeout=120, headers=headers) as c:
            for i in range(10**6):
                if self.stopped.is_set():
                    return
                prompt = families.PROMPTS[i % 3]  # the short ones: room for LOAD_TOKENS in max_model_len
                try:
                    r = c.post("/inference/v1/generate", json={"token_ids": prompt, "sampling_params": {
                        "max_tokens": LOAD_TOKENS, "temperature": 0, "ignore_eos": True}})
                    self.answers.append((prompt, r.status_code, r.json()["choices"][0] if r.status_code == 200
                                         else r.text))
                except httpx.HTTPError as e:
                    self.answers.append((prompt, None, repr(e)))


class Reference:
    """Transformers' greedy continuations of each version, computed once each."""

    def __init__(self):
        self.models, self.memo = {}, {}

    def tokens(self, version: int, context: list[int], n: int) -> list[int]:
        key = (version, tuple(context), n)
        if key not in self.memo:
            if version not in self.models:
                self.models[version] = families.hf_model(FAMILY, SEED[version])
            self.memo[key] = families.greedy(self.models[version], [context], n)[0]
        return self.memo[key]


def versions_told_truly(answers: list, reference: Reference, versions: set[int]) -> dict[str, int]:
    """Every answer 200, its tokens covered by the versions it reports (``weight_versions``), each
    version's part what transformers continues with that version: no token of a version the
    answer did not name. Figures: answers on each version, and spanning two."""
    figures = {"answers": len(answers), "spanning two versions": 0, "aborted before a token": 0,
               **{f"on {v}": 0 for v in sorted(versions)}}
    for prompt, status, choice in answers:
        assert status == 200, (status, choice)
        tokens, spans = choice["token_ids"], choice["weight_versions"]
        if not tokens:  # pause_mode abort caught it before its first token: no token, so no version
            assert spans == [] and choice["finish_reason"] == "abort", choice
            figures["aborted before a token"] += 1
            continue
        assert [sp["start"] for sp in spans] == [0] + [sp["end"] for sp in spans[:-1]] and \
            spans[-1]["end"] == len(tokens), spans
        figures["spanning two versions"] += len(spans) > 1
        for sp in spans:
            v = int(sp["version"])
            assert v in versions, (v, versions)
            figures[f"on {v}"] += 1
            n = min(CHECKED, sp["end"] - sp["start"])
            got = tokens[sp["start"]:sp["start"] + n]
            want = reference.tokens(v, prompt + tokens[:sp["start"]], n)
            assert got == want, f"tokens reported as version {v}: {got}, version {v} gives {want} ({spans})"
    return figures


def reload_pause_mode(node: Node, mode: str) -> None:
    """The daemon's update.pause_mode set by a reload: no server restarted."""
    d = node.daemon
    d.write({**d.cfg, "update": {**d.cfg.get("update", {}), "pause_mode": mode}})
    r = d.action("/reload")
    assert r.status_code == 200 and "restarted none" in r.json()["message"], r.text


def on_version(node: Node, version: int) -> None:
    """Every server of ``node`` on ``version`` (published here unless the tests before did: a test
    run alone finds its node on A)."""
    d = node.daemon
    if any(d.server(name)["version"] != version for name in node.gateways):
        if version not in [v["version"] for v in node.reg.versions()]:
            node.reg.publish(version, families.hf_model(FAMILY, SEED[version]))
        d.wait_versions({name: version for name in node.gateways}, 300)


def every_pause_mode(node: Node, loaded: str) -> None:
    """One version per pause mode, published while requests run through ``loaded``'s gateway (on
    each of its engines): the update ends (no deadlock), every request is answered, by the
    versions it reports; then every engine serves the new version exactly (its prefix cache of
    the old weights dropped: served_exactly)."""
    on_version(node, min(MODES) - 1)
    reference, d = Reference(), node.daemon
    incarnations = {name: d.server(name)["incarnation"] for name in node.gateways}
    # Each version's model and outputs before any load: beside the load (the ranks spinning on both
    # cores) transformers took up to 59 s for what takes 1 s on an idle machine.
    models = {version: families.hf_model(FAMILY, SEED[version]) for version in MODES}
    wants = {version: families.greedy(model, families.PROMPTS, NEW_TOKENS) for version, model in models.items()}
    for version, mode in MODES.items():
        reload_pause_mode(node, mode)
        pauses = d.log_text().count(f"/pause?mode={mode}&")
        loads = [Load(node.gateways[loaded], rank) for rank in node.ranks(loaded)]
        for load in loads:
            load.start()
        try:
            wait_until(lambda: all(load.answers for load in loads), 60, "the load answered")  # noqa: B023
            t0 = time.monotonic()
            node.reg.publish(version, models[version])
            d.wait_versions({name: version for name in node.gateways}, 120)
            took = time.monotonic() - t0
            wait_until(lambda: all(load.answered_on(version) for load in loads), 60,  # noqa: B023
                       f"the load answered on version {version}")
        finally:  # also on a failure: a load left running would be counted by the node's next test
            for load in loads:
                load.stopped.set()
            for load in loads:
                load.stop()
        figures = versions_told_truly([a for load in loads for a in load.answers], reference, {version - 1, version})
        assert d.log_text().count(f"/pause?mode={mode}&") == pauses + len(node.gateways), f"not paused with {mode}"
        served_exactly(node, version, wants[version])
        print(f"{loaded} pause_mode {mode}: version {version} served {took:.1f} s after its publish; "
              f"paused {node.paused_s[loaded][version]:.3f} s; load {figures}")
    assert {name: d.server(name)["incarnation"] for name in node.gateways} == incarnations, "a server restarted"


def test_a_tp_server_is_updated_in_every_pause_mode_under_load(nodes):
    every_pause_mode(nodes.get("tp"), TP)


def engine_answers(node: Node, name: str) -> dict[str, float]:
    """Requests each engine of DP server ``name`` finished, by vLLM's own count: engine -> count."""
    with node.daemon.vllm(name) as c:
        text = c.get("/metrics").text
    counts: dict[str, float] = {}
    for engine, n in re.findall(r'^vllm:request_success_total\{engine="(\d+)"[^}]*\} ([\d.e+]+)$', text, re.M):
        counts[engine] = counts.get(engine, 0.0) + float(n)
    return counts


def test_a_data_parallel_server_is_updated_a_b_c_exactly_on_every_engine(nodes):
    """Two engines behind two API server processes on the server's one UNIX socket: every
    version's outputs of each engine, asked by name, equal transformers'."""
    node = nodes.get("dp")
    log = node.daemon.log_text()
    assert "Started 2 API server processes" in log, log[-3000:]
    with node.daemon.vllm(DP) as c:
        assert c.get("/get_world_size").json()["world_size"] == 2  # the engines' workers together
    a_to_c(node)
    gates = re.findall(r"gate dp2: version (\d+) passed \(.*; each of 2 data-parallel engines\)",
                       node.daemon.log_text())
    assert gates == ["1", "2"], gates


def test_a_dp_engine_killed_mid_update_is_in_backoff_within_seconds(nodes):
    killed_mid_update(nodes.get("dp"), DP, "EngineCore_DP1")


def test_a_dp_server_is_updated_in_every_pause_mode_under_load(nodes):
    every_pause_mode(nodes.get("dp"), DP)


def test_a_dp_engine_killed_while_serving_is_in_backoff_within_seconds(nodes):
    """An engine of the DP server on the newest version (the last of every_pause_mode) killed: the
    server is in BACKOFF within seconds, nothing of its old group is left (processes, /dev/shm
    segments, TMPDIR), and a new incarnation starts. Last in the file: the node then stops while
    that incarnation starts, and nothing of it may be left either (Node.close). That a restarted DP
    server serves its node's version exactly on every engine is the mid-update kill's check; here
    it would only add another start of both engines."""
    node, version = nodes.get("dp"), max(MODES)
    on_version(node, version)
    d = node.daemon
    before = d.server(DP)
    assert (before["state"], before["version"]) == ("SERVING", version), before
    pid = before["pid"]
    segments, old_tmp = held(node, pid)
    victim = _process(pid, "EngineCore_DP1")
    t0 = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    d.wait(lambda s: d.server(DP, s)["state"] == "BACKOFF", 30, "BACKOFF")
    to_backoff = time.monotonic() - t0
    group_gone(node, pid, segments, old_tmp)
    d.wait(lambda s: d.server(DP, s)["incarnation"] == before["incarnation"] + 1, 60, "the next incarnation")
    print(f"EngineCore_DP1 killed while serving: BACKOFF after {to_backoff:.1f} s, restarting after "
          f"{time.monotonic() - t0:.1f} s; segments of the old group: {sorted(segments)}")
    assert to_backoff < 10, to_backoff
    said = f"its process VLLM::EngineCore_DP1 (pid {victim}) exited"
    assert said in d.log_text(), "the supervisor did not see the engine go"
