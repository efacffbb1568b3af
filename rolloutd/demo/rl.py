"""``rolloutd demo rl``: a policy that learns through the fleet, on CPU, in a few minutes.

The whole loop of asynchronous RL post-training on one machine without a GPU:

- **the policy**: a tiny Qwen2-shaped model with tied embeddings (:mod:`rolloutd.demo.families`'
  ``qwen2``, with a vocabulary of :data:`VOCAB` tokens and a word-level tokenizer built here),
  trained in torch by this process;
- **the task**, verifiable: the prompt is ``<s> a b c d =`` with four digits among
  :data:`DIGITS` tokens; the answer is :data:`ANSWER_TOKENS` tokens, and the reward is the
  share of them equal to the **first** digit ``a``. The untrained model spreads its
  probability over the whole vocabulary (reward about 1/64);
- **the fleet**: the registry embedded in this process, and one node, the daemon (``rolloutd
  run`` as its own process) with two real ``vllm serve`` (vLLM's CPU build), one per core;
- **generation only through** :class:`rolloutd.fleet.Fleet`: each step's batch (``--prompts``
  prompts, ``--samples`` samples each, each request seeded) is asked of the fleet with
  ``min_version`` = the trainer's version at training time minus ``k`` (``--max-staleness``):
  no sample is ever more than ``k`` versions behind the weights it trains. The next batch is
  generated while the trainer trains on this one (asynchronous RL);
- **the update**: GRPO, one gradient step per batch: group-normalised rewards, and the
  PPO-clipped ratio of the trainer's logprobs to the ones vLLM sampled with (the behaviour
  policy, which may be up to ``k`` versions old); then a version is **published every step**,
  with a canary, and the node pulls it, pauses each server briefly and loads it.

It runs the loop twice: first **frozen** (updates off: nothing is published after version 1,
so the fleet serves the starting weights throughout; the trainer trains all the same), then
**learning** (a version per step). Per step it prints the mean reward, the versions the batch
came from, and where the time went: ``train``, ``publish``, and the node's ``pull`` and
``pause`` of the last version it loaded, and ``generate`` (the batch's generation, and how long
the trainer waited for it). The last line of stdout is one JSON object: ``reward_first`` and
``reward_last`` (mean reward of the first and last ``--window`` steps) of the learning run,
``frozen_reward_first`` and ``frozen_reward_last`` of the frozen one, ``steps``, ``k``,
``max_staleness`` (the most versions any trained sample was behind). Only the learning run
learns: the proof that the weights flow from the trainer to the servers. Exit status 0 when it
did (:func:`learned`), 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from rolloutd.demo import families
from rolloutd.demo.cpu_vllm import CPU_ENV, cpu_args
from rolloutd.demo.serve import _free_port, default_vllm
from rolloutd.demo.tinymodel import BOS_ID, EOS_ID, SPECIAL_TOKENS
from rolloutd.fleet import Fleet, Generation, Sampling
from rolloutd.trainer.publish import EmbeddedRegistry

VOCAB = 64
DIGITS = [3, 4, 5, 6]  # the digit tokens a prompt is made of
SEP = 7  # "=": the answer follows
PROMPT_DIGITS = 4
ANSWER_TOKENS = 4
SERVERS = 2
LR = 3e-3
CLIP = 0.2  # PPO's ratio clip


def say(msg: str) -> None:
    print(f"rl: {msg}", flush=True)


# -- the task --------------------------------------------------------------------------------------

def make_prompt(rng: random.Random) -> list[int]:
    return [BOS_ID, *(rng.choice(DIGITS) for _ in range(PROMPT_DIGITS)), SEP]


def reward(prompt: list[int], answer: list[int]) -> float:
    """The share of answer tokens equal to the prompt's first digit."""
    return sum(t == prompt[1] for t in answer) / len(answer) if answer else 0.0


# -- the policy ------------------------------------------------------------------------------------

def build_policy(directory: Path, seed: int = 0) -> Path:
    """A servable tiny tied Qwen2 (transformers' own initialisation: near-uniform outputs) with a
    word-level tokenizer of VOCAB tokens; returns the directory."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = families.hf_config("qwen2")
    cfg.vocab_size = VOCAB
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # tied
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    (directory / "generation_config.json").write_text(json.dumps({"bos_token_id": BOS_ID, "eos_token_id": EOS_ID}))
    _write_tokenizer(directory)
    for f in directory.iterdir():
        f.chmod(0o644)
    return directory


def _write_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    names = SPECIAL_TOKENS + [f"d{i}" for i in range(len(DIGITS))] + ["="]
    names += [f"t{i}" for i in range(len(names), VOCAB)]
    tok = Tokenizer(models.WordLevel({n: i for i, n in enumerate(names)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "model_max_length": 512}))


@dataclass
class Sample:
    prompt: list[int]
    gen: Generation
    reward: float

    @property
    def oldest(self) -> int:
        return min(self.gen.versions)


class Trainer:
    """GRPO on the policy, one gradient step per batch."""

    def __init__(self, model_dir: Path):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                          attn_implementation="eager")
        self.model.train()
        self.opt = torch.optim.Adam(self.model.parameters(), lr=LR)

    def step(self, batch: list[list[Sample]]) -> dict:
        """One update on groups of samples of one prompt each; returns what it measured."""
        torch = self.torch
        samples = [s for group in batch for s in group]
        plen = len(samples[0].prompt)
        ids = torch.tensor([s.prompt + s.gen.token_ids for s in samples])
        behaviour = torch.tensor([s.gen.logprobs for s in samples])
        advantage = torch.cat([_advantages(torch, [s.reward for s in group]) for group in batch])[:, None]
        logits = self.model(input_ids=ids).logits[:, plen - 1:-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, plen:, None])[..., 0]
        ratio = torch.exp(logp - behaviour)
        loss = -torch.minimum(ratio * advantage, ratio.clamp(1 - CLIP, 1 + CLIP) * advantage).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return {"loss": float(loss), "ratio_max": float(ratio.max())}

    def served_gap(self, samples: list[Sample], version: int) -> float | None:
        """Max |trainer logprob - served logprob| over samples made entirely by ``version`` (the
        trainer's current weights): how exactly the servers run the published weights."""
        torch = self.torch
        same = [s for s in samples if s.gen.versions == [version]]
        if not same:
            return None
        plen = len(same[0].prompt)
        ids = torch.tensor([s.prompt + s.gen.token_ids for s in same])
        with torch.no_grad():
            logits = self.model(input_ids=ids).logits[:, plen - 1:-1].float()
            logp = torch.log_softmax(logits, -1).gather(-1, ids[:, plen:, None])[..., 0]
        return float((logp - torch.tensor([s.gen.logprobs for s in same])).abs().max())

    def canary(self, prompt: list[int]):
        from rolloutd.trainer.canary import make_canary
        return make_canary(self.model, prompt, new_tokens=8)


def _advantages(torch, rewards: list[float]):
    r = torch.tensor(rewards)
    return (r - r.mean()) / (r.std() + 1e-4)


# -- the node ----------------------------------------------------------------------------------------

def node_config(work: Path, registry_url: str, vllm: str, model: Path) -> dict:
    cores = sorted(os.sched_getaffinity(0))
    servers = [{"name": f"cpu{i}", "model": str(model), "public_port": _free_port(), "cpus": [cores[i % len(cores)]],
                "env": {"VLLM_CPU_OMP_THREADS_BIND": str(cores[i % len(cores)])}} for i in range(SERVERS)]
    return {
        "node": {"name": "rl-node", "advertise_host": "127.0.0.1"},
        "registry": {"url": registry_url, "long_poll_s": 10},
        "admin": {"port": _free_port()},
        "gateway": {"host": "127.0.0.1"},
        "state_dir": str(work / "state"),
        "mirror": {"dir": str(work / "mirror"), "max_bytes": "256MiB"},
        "heartbeat": {"interval_s": 0.5},
        "health": {"interval_s": 1},
        "restart": {"start_timeout_s": 900},
        "vllm": {"command": [vllm, "serve"],
                 "args": cpu_args(max_model_len=64, max_num_seqs=64), "env": dict(CPU_ENV)},
        "servers": servers,
    }


class Node:
    """``rolloutd run`` as its own process, as on an inference node; its log in ``work``."""

    def __init__(self, work: Path, cfg: dict):
        self.path, self.log = work / "rolloutd.yaml", work / "rolloutd.log"
        self.path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        self.admin = f"http://127.0.0.1:{cfg['admin']['port']}"
        self.proc: subprocess.Popen | None = None
        self.pulls: dict[int, float] = {}  # version -> seconds its pull took
        self.loads: dict[int, dict[str, float]] = {}  # version -> server -> seconds it was paused to load it

    def start(self) -> Node:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "rolloutd.cli", "run", "-c", str(self.path)],
                                         stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        return self

    async def status(self) -> dict | None:
        try:
            async with httpx.AsyncClient(timeout=5) as c:
                return (await c.get(self.admin + "/status")).json()
        except (httpx.HTTPError, ValueError):
            return None

    async def watch(self) -> None:
        """Note every pull and load the node completes (the admin API shows only the last one,
        and with a version a step they follow each other fast)."""
        while True:
            st = await self.status() or {}
            pull = st.get("pull") or {}
            if pull.get("state") == "done" and pull.get("version"):
                self.pulls[pull["version"]] = float(pull["seconds"])
            for s in st.get("servers", []):
                u = s.get("last_update") or {}
                if u.get("ok"):
                    paused = float((u.get("phases_s") or {}).get("paused", 0.0))
                    self.loads.setdefault(u["version"], {})[s["name"]] = paused
            await asyncio.sleep(0.25)

    def update_times(self) -> str:
        """The pull, and the longest pause of a server, of the newest version every server loaded."""
        done = [v for v, by in self.loads.items() if len(by) == SERVERS]
        if not done:
            return "pull -  pause -"
        version = max(done)
        pull = self.pulls.get(version)
        return (f"pull {pull:.2f} s" if pull is not None else "pull -") + \
            f"  pause {max(self.loads[version].values()):.2f} s (v{version})"

    async def wait_serving(self, fleet: Fleet, version: int, timeout_s: float) -> None:
        """Until every server serves ``version`` in the fleet's view; RuntimeError as soon as the
        daemon exits or a server is given up (FATAL), with its last error."""
        deadline = time.monotonic() + timeout_s
        while len(fleet.directory.usable(version)) < SERVERS:
            self.check_alive()
            st = await self.status() or {}
            fatal = [s for s in st.get("servers", []) if s.get("state") == "FATAL"]
            if fatal:
                raise RuntimeError(f"server {fatal[0]['name']} failed: {fatal[0].get('last_error')} (see {self.log})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the servers did not serve version {version} within {timeout_s:g} s "
                                   f"({fleet.directory.describe()}; see {self.log})")
            await asyncio.sleep(0.5)

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"rolloutd exited with {self.proc.returncode}; see {self.log}")

    def stop(self, timeout_s: float = 90) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)  # an ordered stop: every vllm serve stopped, then the daemon
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


# -- the loop ---------------------------------------------------------------------------------------

@dataclass
class Run:
    name: str
    rewards: list[float] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)


class Loop:
    """One run of the RL loop: generate through the fleet, train, publish (unless frozen)."""

    def __init__(self, args: argparse.Namespace, fleet: Fleet, reg: EmbeddedRegistry, node: Node,
                 model_dir: Path, *, version: int, publish: bool):
        self.args, self.fleet, self.reg, self.node = args, fleet, reg, node
        self.trainer = Trainer(model_dir)
        self.version, self.publish = version, publish
        self.rng = random.Random(args.seed)
        self.run = Run("learn" if publish else "frozen")

    async def generate(self, step: int, min_version: int) -> tuple[list[list[Sample]], float]:
        """The batch of ``step``: every request at ``min_version`` or newer; and its seconds."""
        started = time.perf_counter()
        prompts = [make_prompt(self.rng) for _ in range(self.args.prompts)]
        jobs = [(p, Sampling(max_tokens=ANSWER_TOKENS, temperature=1.0, ignore_eos=True,
                             seed=(self.args.seed << 40) + (step << 20) + i * self.args.samples + j))
                for i, p in enumerate(prompts) for j in range(self.args.samples)]
        gens = await asyncio.gather(*(self.fleet.generate(p, s, min_version=min_version) for p, s in jobs))
        samples = [Sample(p, g, reward(p, g.token_ids)) for (p, _), g in zip(jobs, gens, strict=True)]
        n = self.args.samples
        return [samples[i:i + n] for i in range(0, len(samples), n)], time.perf_counter() - started

    def floor(self) -> int:
        """The oldest version the next batch may come from: it trains the weights that become
        ``self.version`` once published, so at most ``k`` versions behind those."""
        return max(1, self.version - self.args.k) if self.publish else 1

    async def go(self) -> Run:
        steps = self.args.steps
        pending = asyncio.ensure_future(self.generate(1, self.floor()))
        try:
            for step in range(1, steps + 1):
                self.node.check_alive()
                waited = time.perf_counter()
                batch, gen_s = await pending
                waited = time.perf_counter() - waited
                if self.publish:
                    self.version += 1  # what this step publishes; the next batch trains those weights ...
                if step < steps:  # ... and is generated meanwhile, from versions at most k behind them
                    pending = asyncio.ensure_future(self.generate(step + 1, self.floor()))
                await self.step(step, batch, gen_s, waited)
        finally:
            if not pending.done():
                pending.cancel()
        return self.run

    async def step(self, step: int, batch: list[list[Sample]], gen_s: float, waited_s: float) -> None:
        samples = [s for g in batch for s in g]
        trained_on = self.version - 1 if self.publish else 1  # the version whose weights this step changes
        gap = None  # (frozen: the trainer's weights are version 1 only before its first step)
        if self.publish or step == 1:
            gap = await asyncio.to_thread(self.trainer.served_gap, samples, trained_on)
        t = time.perf_counter()
        await asyncio.to_thread(self.trainer.step, batch)
        train_s, publish_s = time.perf_counter() - t, 0.0
        if self.publish:
            t = time.perf_counter()
            canary = await asyncio.to_thread(self.trainer.canary, samples[0].prompt)
            await asyncio.to_thread(self.reg.publish, self.version, self.trainer.model.state_dict(), canary=canary)
            publish_s = time.perf_counter() - t
        mean = sum(s.reward for s in samples) / len(samples)
        stale = max(trained_on - s.oldest for s in samples) if self.publish else None
        self.run.rewards.append(mean)
        if stale is not None:
            self.run.staleness.append(stale)
        seen = Counter(tuple(s.gen.versions) for s in samples)
        say(f"{self.run.name} step {step:2d}/{self.args.steps}  reward {mean:.3f}  versions "
            + " ".join(f"v{'+'.join(map(str, v))}:{n}" for v, n in sorted(seen.items()))
            + (f"  staleness {stale}" if stale is not None else "")
            + f"  | train {train_s:.2f} s  publish {publish_s:.2f} s  {self.node.update_times()}"
            + f"  generate {gen_s:.2f} s (waited {waited_s:.2f} s)"
            + (f"  | served-vs-trainer max |dlogprob| {gap:.1e}" if gap is not None else ""))


def window_mean(values: list[float], n: int, last: bool) -> float:
    part = values[-n:] if last else values[:n]
    return round(sum(part) / len(part), 4)


def learned(summary: dict) -> bool:
    """The learning run clearly improved (at least 0.1 and twice its start) and the frozen one did not."""
    up = summary["reward_last"] >= max(2 * summary["reward_first"], summary["reward_first"] + 0.1)
    frozen_flat = summary["frozen_reward_last"] < summary["frozen_reward_first"] + 0.05
    return up and frozen_flat and summary["max_staleness"] <= summary["k"]


# -- the demo ----------------------------------------------------------------------------------------

async def _run(args: argparse.Namespace, work: Path) -> dict:
    import torch
    torch.set_num_threads(1)  # the servers have the cores; a tiny model trains fine on one thread
    model_dir = await asyncio.to_thread(build_policy, work / "policy-0", args.seed)
    say(f"built a tiny tied Qwen2 policy (vocabulary {VOCAB}) in {model_dir}")
    started = time.perf_counter()
    with EmbeddedRegistry(port=0) as reg:
        trainer = Trainer(model_dir)
        reg.publish(1, trainer.model.state_dict(), canary=trainer.canary(make_prompt(random.Random(0))))
        node = Node(work, node_config(work, reg.url, args.vllm, model_dir)).start()
        say(f"registry on {reg.url}; rolloutd run with {SERVERS} vllm serve (log: {node.log}); waiting for both "
            "to serve version 1")
        watch = asyncio.ensure_future(node.watch())
        try:
            async with Fleet(reg.url, refresh_s=0.25, wait_s=args.start_timeout_s) as fleet:
                await node.wait_serving(fleet, 1, args.start_timeout_s)
                say(f"fleet: {', '.join(r['replica_id'] + ' at ' + r['endpoint'] for r in fleet.replicas())}")
                frozen = await Loop(args, fleet, reg, node, model_dir, version=1, publish=False).go()
                learn = await Loop(args, fleet, reg, node, model_dir, version=1, publish=True).go()
                stats = dict(fleet.stats)
        finally:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
            node.stop()
    w = args.window
    return {"reward_first": window_mean(learn.rewards, w, False), "reward_last": window_mean(learn.rewards, w, True),
            "frozen_reward_first": window_mean(frozen.rewards, w, False),
            "frozen_reward_last": window_mean(frozen.rewards, w, True),
            "steps": args.steps, "k": args.k, "max_staleness": max(learn.staleness), "window": w,
            "versions_published": args.steps + 1, "requests": stats.get("answered", 0),
            "retries": sum(v for k, v in stats.items() if k.startswith("retry_")),
            "continued": stats.get("continued", 0), "seconds": round(time.perf_counter() - started, 1)}


def run_rl(args: argparse.Namespace) -> int:
    from rolloutd.httpserver import run
    if args.steps < args.window:
        raise ValueError(f"--steps ({args.steps}) must be at least --window ({args.window})")
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="rolloutd-rl-"))
    try:
        summary = run(_run(args, work))
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    return report(summary)


def report(summary: dict) -> int:
    """The verdict of a learning demo (``demo rl``, ``demo trl``), then its summary as the last line."""
    ok = learned(summary)
    say(("learned: " if ok else "did NOT learn as expected: ")
        + f"reward {summary['reward_first']} -> {summary['reward_last']} with updates, "
        f"{summary['frozen_reward_first']} -> {summary['frozen_reward_last']} with the fleet held on version 1; "
        f"max staleness {summary['max_staleness']} (k = {summary['k']})")
    print(json.dumps(summary), flush=True)
    return 0 if ok else 1


def add_parser(sub) -> None:
    p = sub.add_parser("rl", help="RL through the fleet on CPU: a tiny policy learns a task from samples "
                       "generated by real vLLM servers, with updates on, and does not with them off")
    add_run_args(p, steps=30)
    p.set_defaults(func=run_rl)


def add_run_args(p, steps: int) -> None:
    """The settings of a learning demo's two runs (``demo rl``, ``demo trl``)."""
    p.add_argument("--vllm", default=default_vllm(), help="the vllm command (default: %(default)s)")
    p.add_argument("--workdir", help="keep the models, mirror, config and daemon log here (default: a temporary "
                   "directory)")
    p.add_argument("--steps", type=int, default=steps, help="training steps of each run (default: %(default)s)")
    p.add_argument("--prompts", type=int, default=16, help="prompts per batch (default: %(default)s)")
    p.add_argument("--samples", type=int, default=8, help="samples per prompt, one GRPO group (default: %(default)s)")
    p.add_argument("-k", "--max-staleness", dest="k", type=int, default=1,
                   help="most versions a trained sample may be behind the trainer (default: %(default)s)")
    p.add_argument("--window", type=int, default=3, help="steps averaged for reward_first / reward_last "
                   "(default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the policy, the prompts and the samples")
    p.add_argument("--start-timeout-s", type=float, default=900, help="longest wait for the servers to serve")
