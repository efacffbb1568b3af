"""The tests of test_trl.py that run one at a time in the slow tier (slow by this folder): TRL's own
trainers through a real fleet; the rest is in tests/integration/trainer/test_trl.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from rolloutd.fleet import Sampling
from rolloutd.trainer.integrations.batches import UnsupportedSetting
from tests.support.trl_task import policy, prompts_dataset, task_reward, trl_args


# -- real TRL trainers ------------------------------------------------------------------------------------
class Fleet:
    """One daemon (``rolloutd run``) with two real ``vllm serve`` on the tiny policy, and the
    registry it follows, embedded here; shared by the trainer tests of this module."""

    def __init__(self, work: Path):
        from rolloutd.demo import rl
        from rolloutd.demo.serve import default_vllm
        from rolloutd.trainer import EmbeddedRegistry
        from tests.support.vllm_server import require_vllm
        require_vllm()
        self.model_dir = policy(work / "policy")
        self.reg = EmbeddedRegistry(port=0).start()
        self.node = None
        try:
            from transformers import AutoModelForCausalLM
            self.reg.publish(1, AutoModelForCausalLM.from_pretrained(self.model_dir).state_dict())
            self.node = rl.Node(work, rl.node_config(work, self.reg.url, default_vllm(), self.model_dir)).start()
            self.wait_serving(1)
        except BaseException:
            self.stop()
            raise

    def wait_serving(self, version: int, timeout_s: float = 900) -> None:
        from rolloutd.fleet import FleetSync
        with FleetSync(self.reg.url, refresh_s=0.25) as fleet:
            fleet.wait_for(version, 2, timeout_s)

    def stop(self) -> None:
        try:
            if self.node is not None:
                self.node.stop()
        finally:
            self.reg.stop()


@pytest.fixture(scope="module")
def two_servers(tmp_path_factory):
    fleet = Fleet(tmp_path_factory.mktemp("trl"))
    yield fleet
    fleet.stop()


class ServedExactly:
    """A callback that checks, at each step, that the fleet serves the version the step published
    with the trainer's weights of that step: the transformers greedy continuation of a probe,
    taken when the step begins (the weights the step publishes), equals the fleet's, asked of
    that version once the step ended."""

    PROBE = [1, 3, 5, 4, 6, 7]

    def __init__(self, generation):
        from transformers import TrainerCallback

        outer = self

        class Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, model=None, **kw):
                outer.reference = outer.greedy_of(model)

            def on_step_end(self, args, state, control, **kw):
                outer.check()

        self.callback, self.generation = Callback(), generation
        self.checked: list[tuple[int, list[int], float]] = []  # version, greedy tokens, max |dlogprob|

    @staticmethod
    def greedy_of(model, n: int = 6) -> tuple[list[int], list[float]]:
        import torch
        ids = list(ServedExactly.PROBE)
        lps = []
        with torch.no_grad():
            for _ in range(n):
                logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
                lp = torch.log_softmax(logits, -1)
                ids.append(int(lp.argmax()))
                lps.append(float(lp.max()))
        return ids[len(ServedExactly.PROBE):], lps

    def check(self) -> None:
        version = self.generation.version  # published at this step's generation
        tokens, lps = self.reference
        out = self.generation.client.generate(self.PROBE, Sampling(max_tokens=len(tokens), temperature=0.0,
                                                                   ignore_eos=True), min_version=version)
        assert out.versions == [version], out.weight_versions  # the newest: nothing newer exists yet
        assert out.token_ids == tokens, (version, out.token_ids, tokens)
        gap = max(abs(a - b) for a, b in zip(out.logprobs, lps, strict=True))
        assert gap < 1e-3, gap
        self.checked.append((version, tokens, gap))


def run_trainer(kind: str, fleet: Fleet, tmp_path: Path, steps: int, k: int):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rolloutd.trainer.integrations import trl as integration
    from rolloutd.trainer.integrations.trl import FleetConfig
    torch.set_num_threads(1)  # the servers have the cores
    model = AutoModelForCausalLM.from_pretrained(fleet.model_dir, dtype=torch.float32, attn_implementation="eager")
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # tied
    cls = {"grpo": integration.GRPOTrainer, "rloo": integration.RLOOTrainer}[kind]
    before = fleet.reg.latest()["version"]
    config = FleetConfig(registry=fleet.reg, max_staleness=k, fleet_options={"wait_s": 300, "refresh_s": 0.25})
    trainer = cls(model, task_reward, args=trl_args(kind, tmp_path / "out", steps),
                  processing_class=AutoTokenizer.from_pretrained(fleet.model_dir), train_dataset=prompts_dataset(64),
                  fleet=config)
    served = ServedExactly(trainer.vllm_generation)
    trainer.add_callback(served.callback)
    try:
        trainer.train()
    finally:
        trainer.vllm_generation.close()
    gen = trainer.vllm_generation
    assert gen.published == list(range(before + 1, before + 1 + steps))  # a version per step
    assert [v for v, _, _ in served.checked] == gen.published
    batches = list(gen.batches)
    assert [b.version for b in batches] == gen.published  # one batch per step, each after its publish
    for b in batches:
        assert all(v is not None and b.version - k <= v <= b.version for s in b.versions for v in s), b
    groups = [batches[0].completions[i:i + 4] for i in range(0, len(batches[0].completions), 4)]
    assert all(len({tuple(c) for c in g}) > 1 for g in groups), groups  # seeded apart: a group is not copies
    replicas = {r for b in batches for s in b.replicas for r in s}
    assert len(replicas) == 2, replicas  # both servers generated
    logs = [e for e in trainer.state.log_history if "rolloutd/staleness" in e]
    assert len(logs) == steps and all(0 <= e["rolloutd/staleness"] <= k for e in logs), logs
    assert all(e["rolloutd/oldest_version"] >= e["rolloutd/version"] - k for e in logs), logs
    return trainer, served, logs


# imports TRL (10 s or more) and builds a real trainer
def test_a_setting_the_fleet_cannot_honour_fails_the_trainer_build(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rolloutd.trainer.integrations.trl import FleetConfig, GRPOTrainer
    with pytest.raises(ValueError, match="max_staleness"):
        FleetConfig(max_staleness=-1)
    model_dir = policy(tmp_path / "policy")
    args = trl_args("grpo", tmp_path / "out", 1, generation_kwargs={"n": 4})
    with pytest.raises(UnsupportedSetting, match=r"generation_kwargs\['n'\]"):
        GRPOTrainer(AutoModelForCausalLM.from_pretrained(model_dir), task_reward, args=args,
                    processing_class=AutoTokenizer.from_pretrained(model_dir), train_dataset=prompts_dataset(8),
                    fleet=FleetConfig(registry_url="http://127.0.0.1:9"))


@pytest.mark.timeout(1200)
def test_grpo_trains_on_the_fleet_a_version_per_step_served_exactly(two_servers, tmp_path):
    trainer, served, logs = run_trainer("grpo", two_servers, tmp_path, steps=3, k=0)
    for e in logs:  # on-policy: TRL's sampling logprobs are the trainer's up to the servers' numerics
        assert e["sampling/sampling_logp_difference/max"] < 1e-3, e
        assert e["rolloutd/staleness"] == 0
    print("grpo", [(e["rolloutd/version"], e["sampling/sampling_logp_difference/max"]) for e in logs],
          "greedy gaps", [g for _, _, g in served.checked])


@pytest.mark.timeout(600)
def test_rloo_trains_on_the_fleet_within_the_staleness_bound(two_servers, tmp_path):
    trainer, served, logs = run_trainer("rloo", two_servers, tmp_path, steps=2, k=1)
    print("rloo", [(e["rolloutd/version"], e["rolloutd/oldest_version"]) for e in logs])


@pytest.mark.timeout(600)
def test_two_trainer_processes_generate_each_and_only_the_main_one_publishes(two_servers, tmp_path):
    """torchrun, two CPU processes (gloo): each process generates its own share of the batch on
    the fleet, both count the same versions, and each version is published once (by the main)."""
    import json
    import subprocess
    import sys

    from tests.conftest import free_port
    before = two_servers.reg.latest()["version"]
    run = subprocess.run([str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", "2",
                          "--master_port", str(free_port()),
                          str(Path(__file__).parents[1] / "support" / "trl_processes.py"),
                          two_servers.reg.url, str(two_servers.model_dir), str(tmp_path), "2"],
                         capture_output=True, text=True, timeout=540)
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    procs = [json.loads((tmp_path / f"process-{i}.json").read_text()) for i in range(2)]
    assert [p["processes"] for p in procs] == [2, 2] and [p["main"] for p in procs] == [True, False]
    versions = list(range(before + 1, before + 3))
    assert all(p["synced"] == versions for p in procs)  # both count the main's versions ...
    assert two_servers.reg.latest()["version"] == versions[-1]  # ... which it published once each
    for p in procs:
        assert [b["version"] for b in p["batches"]] == versions
        assert all(v == [b["version"]] for b in p["batches"] for v in b["versions"])  # k = 0
    ours, theirs = ([c for b in p["batches"] for c in b["completions"]] for p in procs)
    assert ours != theirs  # each process generated its own samples


@pytest.mark.timeout(900)
def test_demo_trl_learns_through_the_fleet_and_not_with_updates_off(two_servers, tmp_path):
    """``rolloutd demo trl``'s two runs (shorter), on this module's servers: from the starting
    weights, reward rises with a version per step and stays flat with the fleet held."""
    import argparse

    from transformers import AutoModelForCausalLM

    from rolloutd.demo import rl
    from rolloutd.demo import trl as demo
    parser = argparse.ArgumentParser()
    demo.add_parser(parser.add_subparsers())
    args = parser.parse_args(["trl", "--steps", "12"])
    start = two_servers.reg.latest()["version"] + 1  # the starting weights, after the other tests' versions
    two_servers.reg.publish(start, AutoModelForCausalLM.from_pretrained(two_servers.model_dir).state_dict())
    two_servers.wait_serving(start)
    summary = demo.both_runs(args, tmp_path, two_servers.reg, two_servers.model_dir)
    print("demo trl", summary)
    assert summary["reward_first"] < 0.1, summary  # the untrained policy fails the task
    assert rl.learned(summary), summary  # up with updates, flat with the fleet held
    assert summary["max_staleness"] <= summary["k"] == 1
    assert start <= summary["versions_served"][0] <= start + 1 and len(summary["versions_served"]) >= 10, summary
