"""The registry service: versions and their bytes, leases, the replica directory and demand,
behind HTTP API v1. The trainer's library (:mod:`rolloutd.trainer`) runs it in-process or talks
to it over HTTP; the node talks to it with :mod:`rolloutd.rollout.registry_client`."""
