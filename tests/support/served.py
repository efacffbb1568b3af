"""What the system tests of served models share: a node (a daemon whose real ``vllm serve``
servers start on a family's weights A, and the registry it follows), greedy outputs through a
server's gateway, and transformers' greedy outputs on the same weights to compare them with.

:class:`OneAtATime` keeps one such node open per module: a second one would only take the
first one's cores.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

import httpx

from rolloutd.demo import families
from rolloutd.trainer import EmbeddedRegistry
from tests.support.daemon_harness import DaemonProcess, config
from tests.support.tls import CONTEXT as TLS

NEW_TOKENS = 16  # greedy tokens compared per prompt
RANK_HEADER = "X-data-parallel-rank"  # vLLM's header: the engine of a data-parallel server that must answer


def generate(url: str, prompts: list[list[int]], rank: int | None = None,
             max_tokens: int = NEW_TOKENS) -> tuple[list[list[int]], set[str]]:
    """Greedy outputs through a server's gateway (``rank``: that engine of a data-parallel server;
    None: vLLM's choice), and the weight versions that produced them."""
    outs, versions = [], set()
    headers = {RANK_HEADER: str(rank)} if rank is not None else {}
    with httpx.Client(base_url=url, timeout=120, headers=headers, verify=TLS) as c:
        for p in prompts:
            r = c.post("/inference/v1/generate", json={"token_ids": p, "sampling_params": {
                "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}})
            r.raise_for_status()
            choice = r.json()["choices"][0]
            outs.append(choice["token_ids"])
            versions |= {span["version"] for span in choice.get("weight_versions") or []}
    return outs, versions


def reference(model) -> list[list[int]]:
    """transformers' greedy decoding of :data:`families.PROMPTS`, with the margins that make token
    equality a fair test."""
    assert families.greedy_margin(model, families.PROMPTS, NEW_TOKENS) > 1e-3, "a near tie: pick other weights"
    return families.greedy(model, families.PROMPTS, NEW_TOKENS)


class Node:
    """One daemon with ``servers`` (``vllm_server(...)`` entries), following ``reg`` (None: a
    registry of its own, stopped with the node). ``sections``: the config's other sections."""

    def __init__(self, directory: Path, servers: list[dict], reg: EmbeddedRegistry | None = None, **sections):
        self.dir = directory
        self.own_registry = reg is None
        self.reg = reg or EmbeddedRegistry(port=0).start()
        try:
            self.daemon = DaemonProcess(config(directory, self.reg.url, servers, **sections), directory)
            self.t0 = time.monotonic()
            self.daemon.start()
        except BaseException:
            self._stop_registry()
            raise

    def serving(self, timeout_s: float = 300) -> dict:
        """Wait until every server is SERVING; returns the status."""
        return self.daemon.wait(lambda s: all(x["state"] == "SERVING" for x in s["servers"]), timeout_s,
                                "every server SERVING")

    def gateway(self, name: str, st: dict | None = None) -> str:
        return f"http://127.0.0.1:{self.daemon.server(name, st)['public_port']}"

    def close(self) -> None:
        """Stop the daemon (it must exit 0), then :meth:`kill` whatever is left anyway."""
        try:
            assert self.daemon.stop(90) == 0, "the daemon did not exit 0"
        finally:
            self.kill()

    def kill(self) -> None:
        """Nothing of the node left: for a node that failed before it had an owner to close it."""
        self.daemon.kill_everything()
        self._stop_registry()

    def _stop_registry(self) -> None:
        if self.own_registry:
            self.own_registry = False  # once: close() after kill() stops it no second time
            self.reg.stop()


T = TypeVar("T")


class OneAtATime(Generic[T]):
    """The open one of several expensive things by key (a model family's world, a kind of node),
    made by ``make(key)``: asking for another key closes the open one first."""

    def __init__(self, make: Callable[[str], T]):
        self.make, self.key, self.open = make, None, None

    def get(self, key: str) -> T:
        if self.open is not None and self.key != key:
            self.close()
        if self.open is None:
            self.open, self.key = self.make(key), key
        return self.open

    def close(self) -> None:
        if self.open is not None:
            opened, self.open = self.open, None
            opened.close()
