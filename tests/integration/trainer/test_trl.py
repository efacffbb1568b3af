"""TRL's trainers generating on the fleet (rolloutd.trainer.integrations.trl).

The fast tests check how TRL's generation settings map onto a request, the per-request seeds,
the logprobs' shape and order, and the staleness check. The slow ones train a tiny tied Qwen2
policy with the real ``GRPOTrainer`` and ``RLOOTrainer`` from the package index, generating only
through one daemon's two real CPU ``vllm serve`` (shared by both tests): each step publishes a
version, and the servers serve exactly that version's weights (greedy tokens equal to
transformers' on the trainer's weights of that step).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from rolloutd.fleet import Generation, Sampling, Span
from rolloutd.trainer.integrations.batches import (
    Batch,
    StaleSample,
    UnsupportedSetting,
    check_batch,
    logprob_rows,
    request_seed,
    sampling_of,
)

# -- the settings -----------------------------------------------------------------------------------


def test_trl_settings_map_onto_one_sampling():
    s, seed = sampling_of(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.1,
                          max_completion_length=33, logprobs=0,
                          generation_kwargs={"seed": 5, "presence_penalty": 0.5, "stop_token_ids": [2, 9]})
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.max_tokens) == (0.7, 0.9, 20, 0.05, 33)
    assert s.extra == {"repetition_penalty": 1.1, "presence_penalty": 0.5}
    assert s.stop_token_ids == (2, 9) and s.logprobs and s.top_logprobs == 0
    assert seed == 5
    params = s.params(33)
    assert params["repetition_penalty"] == 1.1 and params["logprobs"] == 0  # the sampled token's logprob only


def test_trl_defaults_and_none_map_to_off():
    s, seed = sampling_of(top_k=None, min_p=None)  # GRPOConfig's min_p default is None
    assert (s.top_k, s.min_p, s.extra, seed) == (0, 0.0, {}, None)


def test_generation_kwargs_override_the_trainer_settings_as_in_trl():
    s, _ = sampling_of(temperature=1.0, max_completion_length=8, repetition_penalty=1.2,
                       generation_kwargs={"temperature": 0.5, "max_tokens": 4, "repetition_penalty": 1.0})
    assert (s.temperature, s.max_tokens, s.extra) == (0.5, 4, {})


@pytest.mark.parametrize(("settings", "words"), [
    ({"generation_kwargs": {"n": 4}}, "n"),
    ({"generation_kwargs": {"stop": ["</s>"]}}, "stop_token_ids"),
    ({"generation_kwargs": {"structured_outputs": {"regex": "a+"}}}, "structured outputs"),
    ({"generation_kwargs": {"best_of": 2}}, "supported:"),
    ({"structured_outputs_regex": "a+"}, "structured"),
    ({"logprobs": 25}, "at most 19"),
    ({"top_p": 0.0}, "top_p"),
    ({"temperature": -1.0}, "temperature"),
])
def test_a_setting_the_fleet_cannot_honour_is_an_error(settings, words):
    with pytest.raises(UnsupportedSetting, match=words):
        sampling_of(**settings)


def test_request_seeds_differ_per_sample_call_and_process():
    seeds = {request_seed(0, p, c, i) for p in range(2) for c in range(3) for i in range(64)}
    assert len(seeds) == 2 * 3 * 64 and all(0 <= s < 2**31 for s in seeds)
    assert request_seed(7, 0, 1, 2) == request_seed(7, 0, 1, 2)


# -- one batch's checks ----------------------------------------------------------------------------------

def gen(tokens: list[int], spans: list[Span], top=None) -> Generation:
    return Generation([1], tokens, [-0.1 * (i + 1) for i in range(len(tokens))], top, "length", spans, ["n.cpu0"])


def test_samples_within_the_bound_are_taken_and_their_staleness_logged():
    batch, metrics = check_batch([gen([3, 4], [Span(4, 0, 1), Span(5, 1, 2)]), gen([3], [Span(5, 0, 1)])], 5, 1)
    assert metrics == {"rolloutd/version": 5.0, "rolloutd/oldest_version": 4.0, "rolloutd/staleness": 1.0,
                       "rolloutd/replicas": 1.0}
    assert batch == Batch(5, 4, [[4, 5], [5]], [["n.cpu0"], ["n.cpu0"]], [[3, 4], [3]])


@pytest.mark.parametrize("spans", [[Span(3, 0, 2)], [Span(5, 0, 1), Span(3, 1, 2)], [Span(None, 0, 2)]])
def test_a_sample_older_than_the_bound_is_refused(spans):
    with pytest.raises(StaleSample, match="below 4"):
        check_batch([gen([3, 4], [Span(5, 0, 2)]), gen([3, 4], spans)], 5, 1)


def test_logprobs_put_the_sampled_token_first_then_the_top_k_others():
    lps, ids = logprob_rows(gen([7, 8], [Span(1, 0, 2)], top=[[(9, -0.05), (7, -0.1)], [(8, -0.2), (11, -1.0)]]))
    assert ids == [[7, 9], [8, 11]] and lps == [[-0.1, -0.05], [-0.2, -1.0]]
    lps, ids = logprob_rows(gen([7, 8], [Span(1, 0, 2)]))
    assert ids == [[7], [8]] and lps == [[-0.1], [-0.2]]  # TRL's shape with logprobs=0: one per position


# -- real TRL trainers ------------------------------------------------------------------------------------

def policy(directory: Path) -> Path:
    """demo rl's tiny tied Qwen2 policy and its word-level tokenizer, with a pad token for TRL."""
    import json

    from rolloutd.demo import rl
    rl.build_policy(directory, seed=0)
    cfg = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**cfg, "pad_token": "<unk>"}))
    return directory


def prompts_dataset(n: int, seed: int = 0):
    """Prompts of demo rl's task as text, with the token the answer should repeat."""
    from datasets import Dataset

    from rolloutd.demo import rl
    rng = random.Random(seed)
    rows = [rl.make_prompt(rng) for _ in range(n)]
    names = {d: f"d{i}" for i, d in enumerate(rl.DIGITS)}
    return Dataset.from_list([{"prompt": "<s> " + " ".join(names[t] for t in p[1:-1]) + " =", "first": p[1]}
                              for p in rows])


def task_reward(prompts, completions, completion_ids, first, **_):
    """Dense, so that every group has spread and every step changes the weights: the share of low
    token ids (``first`` is there only for the demo's task)."""
    return [sum(t < 32 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def trl_args(kind: str, out: Path, steps: int, **kw):
    import trl
    config = {"grpo": trl.GRPOConfig, "rloo": trl.RLOOConfig}[kind]
    return config(output_dir=str(out), use_cpu=True, bf16=False, per_device_train_batch_size=8, num_generations=4,
                  max_completion_length=4, max_steps=steps, learning_rate=3e-3, logging_steps=1, report_to=[],
                  save_strategy="no", seed=0, temperature=1.0, disable_tqdm=True, dataloader_num_workers=0, **kw)


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


def test_the_daemon_and_the_cli_import_no_trainer_library():
    import subprocess
    import sys
    code = ("import sys\nimport rolloutd.cli, rolloutd.node.daemon, rolloutd.fleet, rolloutd.registry\n"
            "print(sorted(m for m in ('trl', 'torch', 'vllm', 'accelerate', 'transformers') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
