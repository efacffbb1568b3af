"""TRL's trainers generating on the fleet (rolloutd.trainer.integrations.trl).

The tests here check how TRL's generation settings map onto a request, the per-request seeds,
the logprobs' shape and order, and the staleness check. tests/system/test_trl.py trains a tiny tied Qwen2
policy with the real ``GRPOTrainer`` and ``RLOOTrainer`` from the package index, generating only
through one daemon's two real CPU ``vllm serve`` (shared by both tests): each step publishes a
version, and the servers serve exactly that version's weights (greedy tokens equal to
transformers' on the trainer's weights of that step).
"""

from __future__ import annotations

import pytest

from rolloutd.fleet import Generation, Span
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


def test_the_daemon_and_the_cli_import_no_trainer_library():
    import subprocess
    import sys
    code = ("import sys\nimport rolloutd.cli, rolloutd.node.daemon, rolloutd.fleet, rolloutd.registry\n"
            "print(sorted(m for m in ('trl', 'torch', 'vllm', 'accelerate', 'transformers') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
