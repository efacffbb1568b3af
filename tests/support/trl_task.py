"""The task TRL's trainers learn in the tests (demo rl's): its tiny tied Qwen2 policy, prompts,
reward, and the trainer's settings. Used by tests/system/test_trl.py and the processes it starts
(tests/support/trl_processes.py)."""

from __future__ import annotations

import random
from pathlib import Path


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
