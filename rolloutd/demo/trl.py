"""``rolloutd demo trl``: TRL's own GRPOTrainer learns through the fleet, on CPU, in a few minutes.

The task, the policy and the node are ``rolloutd demo rl``'s (:mod:`rolloutd.demo.rl`): a tiny
tied Qwen2 policy, prompts ``<s> a b c d =``, reward the share of the answer's tokens equal to
``a``; one daemon (``rolloutd run`` as its own process) with two real ``vllm serve``. The trainer
is TRL's ``GRPOTrainer`` (``pip install 'rolloutd[trl]'``) equipped by
:mod:`rolloutd.trainer.integrations.trl`: at every step it publishes the policy as a version, and every
sample is generated on the fleet with ``min_version`` = that version minus ``k``.

It trains twice: first **frozen** (nothing is published after version 1: the servers keep the
starting weights while the trainer trains), then **learning**. Per step it prints the mean
reward, the versions the batch came from, the staleness and TRL's sampling-vs-trainer logprob
difference. The last line of stdout is one JSON object: ``steps``, ``reward_first`` and
``reward_last`` (mean reward of the first and last ``--window`` steps of the learning run),
``frozen_reward_first`` and ``frozen_reward_last``, ``max_staleness`` (the most versions any
trained sample was behind), ``versions_served`` (every version the learning run's samples came
from). Exit status 0 when only the learning run learned.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path

from rolloutd.demo import rl


def say(msg: str) -> None:
    print(f"trl: {msg}", flush=True)


def build_policy(directory: Path, seed: int) -> Path:
    """demo rl's policy, with the pad token TRL's batches need."""
    rl.build_policy(directory, seed)
    path = directory / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "pad_token": "<unk>"}))
    return directory


def dataset(n: int, seed: int):
    """demo rl's prompts as text for TRL, each with the token its answer should repeat."""
    from datasets import Dataset

    rng = random.Random(seed)
    names = {d: f"d{i}" for i, d in enumerate(rl.DIGITS)}
    rows = [rl.make_prompt(rng) for _ in range(n)]
    return Dataset.from_list([{"prompt": "<s> " + " ".join(names[t] for t in p[1:-1]) + " =", "first": p[1]}
                              for p in rows])


def reward(prompts, completions, completion_ids, first, **_):
    """demo rl's reward, on the completion's token ids."""
    return [sum(t == f for t in ids) / rl.ANSWER_TOKENS for ids, f in zip(completion_ids, first, strict=True)]


def printer(name: str, steps: int, generation):
    """A TrainerCallback that prints one line per logged step and keeps the rewards and staleness."""
    from transformers import TrainerCallback

    class Printer(TrainerCallback):
        def __init__(self):
            self.rewards: list[float] = []
            self.staleness: list[int] = []
            self.versions: set[int] = set()  # every version a sample came from

        def on_log(self, args, state, control, logs=None, **kw):
            if not logs or "reward" not in logs:
                return
            batch = generation.batches[-1]
            seen = Counter(tuple(v) for v in batch.versions)
            self.versions.update(v for vs in batch.versions for v in vs if v is not None)
            self.rewards.append(float(logs["reward"]))
            self.staleness.append(int(logs["rolloutd/staleness"]))
            gap = logs.get("sampling/sampling_logp_difference/max")
            say(f"{name} step {state.global_step:2d}/{steps}  reward {logs['reward']:.3f}  versions "
                + " ".join(f"v{'+'.join(map(str, v))}:{n}" for v, n in sorted(seen.items()))
                + f"  staleness {int(logs['rolloutd/staleness'])}"
                + (f"  | sampling-vs-trainer max |dlogprob| {gap:.1e}" if gap is not None else ""))

    return Printer()


def train(args: argparse.Namespace, work: Path, reg, model_dir: Path, *, publish: bool) -> tuple[object, object]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback
    from trl import GRPOConfig

    from rolloutd.trainer.integrations.trl import FleetConfig, GRPOTrainer

    name = "learn" if publish else "frozen"
    config = GRPOConfig(output_dir=str(work / name), use_cpu=True, bf16=False, seed=args.seed,
                        per_device_train_batch_size=args.prompts * args.samples, num_generations=args.samples,
                        max_completion_length=rl.ANSWER_TOKENS, max_steps=args.steps, learning_rate=rl.LR,
                        lr_scheduler_type="constant", logging_steps=1, report_to=[], save_strategy="no",
                        temperature=1.0, disable_tqdm=True, dataloader_num_workers=0,
                        generation_kwargs={"ignore_eos": True})
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    fleet = FleetConfig(registry=reg, max_staleness=args.k, publish=publish,
                        fleet_options={"wait_s": args.start_timeout_s, "refresh_s": 0.25})
    trainer = GRPOTrainer(model, reward, args=config, processing_class=AutoTokenizer.from_pretrained(model_dir),
                          train_dataset=dataset(args.prompts * args.steps * 2, args.seed), fleet=fleet)
    trainer.remove_callback(PrinterCallback)
    callback = printer(name, args.steps, trainer.vllm_generation)
    trainer.add_callback(callback)
    try:
        trainer.train()
    finally:
        trainer.vllm_generation.close()
    return callback, trainer.vllm_generation


def _run(args: argparse.Namespace, work: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from rolloutd.fleet import FleetSync
    from rolloutd.trainer.publish import EmbeddedRegistry

    torch.set_num_threads(1)  # the servers have the cores; a tiny model trains fine on one thread
    model_dir = build_policy(work / "policy-0", args.seed)
    started = time.perf_counter()
    with EmbeddedRegistry(port=0) as reg:
        reg.publish(1, AutoModelForCausalLM.from_pretrained(model_dir).state_dict())
        node = rl.Node(work, rl.node_config(work, reg.url, args.vllm, model_dir)).start()
        say(f"registry on {reg.url}; rolloutd run with {rl.SERVERS} vllm serve (log: {node.log}); waiting for both "
            "to serve version 1")
        try:
            with FleetSync(reg.url, refresh_s=0.25) as fleet:
                fleet.wait_for(1, rl.SERVERS, args.start_timeout_s)
            summary = both_runs(args, work, reg, model_dir)
        finally:
            node.stop()
    return {**summary, "seconds": round(time.perf_counter() - started, 1)}


def both_runs(args: argparse.Namespace, work: Path, reg, model_dir: Path) -> dict:
    """The frozen run, then the learning one, on a fleet that serves the policy's starting weights
    as the registry's newest version; their summary."""
    frozen, _ = train(args, work, reg, model_dir, publish=False)
    learn, _ = train(args, work, reg, model_dir, publish=True)
    w = args.window
    return {"steps": args.steps, "k": args.k, "window": w,
            "reward_first": rl.window_mean(learn.rewards, w, False),
            "reward_last": rl.window_mean(learn.rewards, w, True),
            "frozen_reward_first": rl.window_mean(frozen.rewards, w, False),
            "frozen_reward_last": rl.window_mean(frozen.rewards, w, True),
            "max_staleness": max(learn.staleness), "versions_served": sorted(learn.versions)}


def run_trl(args: argparse.Namespace) -> int:
    if args.steps < args.window:
        raise ValueError(f"--steps ({args.steps}) must be at least --window ({args.window})")
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="rolloutd-trl-"))
    try:
        summary = _run(args, work)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    return rl.report(summary)


def add_parser(sub) -> None:
    p = sub.add_parser("trl", help="TRL's GRPOTrainer learns through the fleet on CPU (needs rolloutd[trl]), and "
                       "does not with updates off")
    rl.add_run_args(p, steps=20)
    p.set_defaults(func=run_trl)
