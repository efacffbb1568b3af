"""One process of a TRL trainer launched by ``torchrun`` (tests/system/test_trl.py): every process builds
the same GRPOTrainer on the fleet, trains, and writes what its generation object saw to
``OUT/process-RANK.json``. ``python trl_processes.py REGISTRY_URL MODEL_DIR OUT STEPS``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main(url: str, model_dir: Path, out: Path, steps: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rolloutd.trainer.integrations.trl import FleetConfig, GRPOTrainer
    from rolloutd.trainer.publish import RegistryHTTP
    from tests.support.trl_task import prompts_dataset, task_reward, trl_args

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    reg = RegistryHTTP(url)
    config = FleetConfig(registry=reg, max_staleness=0, fleet_options={"wait_s": 300, "refresh_s": 0.25})
    trainer = GRPOTrainer(model, task_reward, args=trl_args("grpo", out / "trainer", steps),
                          processing_class=AutoTokenizer.from_pretrained(model_dir),
                          train_dataset=prompts_dataset(64), fleet=config)
    try:
        trainer.train()
    finally:
        trainer.vllm_generation.close()
        reg.close()
    gen, acc = trainer.vllm_generation, trainer.accelerator
    (out / f"process-{acc.process_index}.json").write_text(json.dumps({
        "processes": acc.num_processes, "main": acc.is_main_process, "synced": gen.published,
        "batches": [{"version": b.version, "versions": b.versions, "replicas": b.replicas,
                     "completions": b.completions} for b in gen.batches]}))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]))
