"""``rolloutd demo rl``: a policy learns through the fleet (real CPU ``vllm serve`` behind the
daemon), and does not when the fleet is held on its first version: the weights flow."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.support.vllm_server import ROOT, VLLM, require_vllm

pytestmark = [pytest.mark.timeout(1500)]

STEPS = 20


def test_the_policy_learns_through_the_fleet_and_not_with_updates_off(tmp_path):
    require_vllm()
    run = subprocess.run([sys.executable, "-m", "rolloutd.cli", "demo", "rl", "--vllm", str(VLLM),
                          "--workdir", str(tmp_path), "--steps", str(STEPS)],
                         capture_output=True, text=True, timeout=1400, cwd=ROOT)
    out = run.stdout
    assert run.returncode == 0, (out + run.stderr)[-6000:]
    summary = json.loads(out.strip().splitlines()[-1])  # the last line of stdout
    assert summary["steps"] == STEPS and summary["k"] == 1
    assert summary["reward_first"] < 0.1  # the untrained policy fails the task
    assert summary["reward_last"] >= max(3 * summary["reward_first"], summary["reward_first"] + 0.15), summary
    assert summary["frozen_reward_last"] < summary["frozen_reward_first"] + 0.05, summary  # held on version 1: flat
    assert summary["frozen_reward_last"] < 0.1, summary
    assert summary["max_staleness"] <= summary["k"]
    learn = re.findall(r"^rl: learn step +(\d+)/\d+ +reward (\S+) +versions (.*?) +staleness (\d+) +\| train (\S+) s "
                       r"+publish (\S+) s +pull (\S+)(?: s)? +pause (\S+) s \(v(\d+)\) +generate (\S+) s", out, re.M)
    frozen = re.findall(r"^rl: frozen step +(\d+)/\d+ +reward \S+ +versions (.*?) +\|", out, re.M)
    assert [int(s[0]) for s in learn] == [int(s[0]) for s in frozen] == list(range(1, STEPS + 1)), out
    assert all(f[1] == "v1:128" for f in frozen), frozen  # every frozen sample from version 1
    seen = [set(re.findall(r"v([\d+]+):", s[2])) for s in learn]
    assert seen[0] == {"1"} and any(v != {"1"} for v in seen[1:])  # the versions move with the trainer
    assert all(int(s[3]) <= 1 for s in learn)
    assert all(float(s[5]) > 0 for s in learn)  # a version published at every step
    loaded = [int(s[8]) for s in learn]
    assert loaded == sorted(loaded) and loaded[-1] >= STEPS // 2, loaded  # the node loads them as they come
    assert "served-vs-trainer max |dlogprob|" in out
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout
    assert left == "", f"processes left behind: {left}"
