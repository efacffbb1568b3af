"""The tests of test_trl.py that run one at a time in the slow tier (slow by this folder);
the rest, and the helpers and fixtures they share, are in tests/integration/trainer/test_trl.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from rolloutd.trainer.integrations.batches import (
    UnsupportedSetting,
)
from tests.integration.trainer import test_trl as rest
from tests.integration.trainer.test_trl import policy, prompts_dataset, run_trainer, task_reward, trl_args

# the module's fixtures, by name, for the tests below
two_servers = rest.two_servers


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
