"""rolloutd inside other trainers: each module plugs the fleet (generation) and the registry
(publishing a version per step) into one trainer library, and is imported only by the trainer
(never by the daemon). ``rolloutd.trainer.integrations.trl``: TRL's GRPO and RLOO trainers
(``pip install 'rolloutd[trl]'``; docs/integration.md)."""
