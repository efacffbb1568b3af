"""The trainer's side of the fleet: generation on the replicas of a registry, under a per-request
version contract (see docs/trainer.md, "Generating")."""

from rolloutd.fleet.client import Fleet
from rolloutd.fleet.errors import (
    FleetError,
    GenerationTimeout,
    NoReplica,
    PromptTooLong,
    Rejected,
    RetriesExhausted,
    Unauthorized,
    VersionRefused,
)
from rolloutd.fleet.result import Generation, Span
from rolloutd.fleet.sampling import Sampling
from rolloutd.fleet.sync import FleetSync

__all__ = ["Fleet", "FleetSync", "Sampling", "Generation", "Span", "FleetError", "NoReplica", "RetriesExhausted",
           "Rejected", "Unauthorized", "PromptTooLong", "GenerationTimeout", "VersionRefused"]
